"""Sphinx configuration of manyheads' documentation.

Build from the repository's root with the docs extra installed:

    pip install '.[docs]'
    sphinx-build -W -b html docs docs/_build/html

The first page is the README (included by index.md); the API reference is
made by autodoc from the package's numpydoc docstrings, so the package must be
importable (installed, with its compiled extension).
"""
from __future__ import annotations

import manyheads

project = "manyheads"
author = "the manyheads authors"
copyright = "the manyheads authors"
version = release = manyheads.__version__

extensions = [
    "myst_parser",            # Markdown pages: index.md and the README it includes
    "sphinx.ext.autodoc",     # the reference, from the docstrings
    "numpydoc",               # which are written in numpydoc's format
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# the README's headings become the first page's sections; anchors for links to them
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "none"          # the numpydoc sections give the types, with shapes
autodoc_default_options = {"members": True}

# every cross-reference must resolve: a renamed or misspelt target fails the build
nitpicky = True

numpydoc_show_class_members = False  # members are documented by autodoc, not as tables
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

html_theme = "alabaster"
html_theme_options = {"page_width": "1180px", "sidebar_width": "230px"}
html_title = f"manyheads {release}"
html_static_path: list[str] = []
