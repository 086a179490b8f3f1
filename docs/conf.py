"""Sphinx configuration of manyheads' documentation.

Build from the repository's root with the docs extra installed:

    pip install '.[docs]'
    sphinx-build -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST): a short front page, the guide in guide/, the
performance page (which includes benchmarks/results/ as the benchmark wrote
it) and the guarantees.  The API reference in api/ is made by autodoc from
the package's numpydoc docstrings, so the package must be importable
(installed, with its compiled extension).  tests/test_docs.py runs the pages'
examples and tests/test_api_reference.py checks that the reference renders
every public method.
"""
from __future__ import annotations

import importlib.util

import manyheads

project = "manyheads"
author = "the manyheads authors"
copyright = "the manyheads authors"
version = release = manyheads.__version__

extensions = [
    "myst_parser",            # the Markdown pages: index, guide, performance, guarantees
    "sphinx.ext.autodoc",     # the reference, from the docstrings
    "numpydoc",               # which are written in numpydoc's format
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# anchors for links to the pages' headings (page.md#a-heading)
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "none"          # the numpydoc sections give the types, with shapes
autodoc_default_options = {"members": True}
# manyheads.torch and manyheads.transformers import torch and transformers: with the docs
# extra alone, autodoc reads them against stand-ins for the packages that are missing
autodoc_mock_imports = [name for name in ("torch", "transformers")
                        if importlib.util.find_spec(name) is None]

# every cross-reference must resolve: a renamed or misspelt target fails the build
nitpicky = True

numpydoc_show_class_members = False  # members are documented by autodoc, not as tables
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

html_theme = "alabaster"
html_theme_options = {"page_width": "1180px", "sidebar_width": "230px"}
html_title = f"manyheads {release}"
html_static_path: list[str] = []
