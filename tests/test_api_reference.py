"""The API reference has an entry for every public method of every public class.

autodoc leaves out what it is not asked for, and some omissions are silent:
methods inherited from a private base class, for instance, are dropped without
a warning, so ``sphinx-build -W`` stays clean.  Here the reference is built
with Sphinx's own autodoc (in a subprocess, with the builder that writes no
pages), the objects it registered in the Python domain are read back, and every
public method (properties, class methods and ``__call__`` included) of every
class the package exports must be among them.  A method inherited from another
exported class counts when that class documents it.
"""
import importlib
import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"

# modules whose __all__ is the public surface the reference documents (the torch and
# transformers front ends when those packages are installed)
PUBLIC_MODULES = ["manyheads", "manyheads.models", "manyheads.cache", "manyheads.interop"] + [
    f"manyheads.{name}" for name in ("torch", "transformers")
    if importlib.util.find_spec(name) is not None]

BUILD = textwrap.dedent("""
    import io, json, sys
    from sphinx.application import Sphinx

    docs, out = sys.argv[1], sys.argv[2]
    warnings = io.StringIO()
    app = Sphinx(docs, docs, out + "/html", out + "/doctrees", "dummy",
                 status=None, warning=warnings, freshenv=True)
    app.build()
    objects = {name: entry.objtype for name, entry in app.env.get_domain("py").objects.items()}
    print(json.dumps({"objects": objects, "warnings": warnings.getvalue()}))
""")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """{full name: object type} of everything the reference renders."""
    if not (DOCS / "conf.py").exists():
        pytest.skip("docs/ not shipped with this copy of the tests")
    for name in ("sphinx", "numpydoc", "myst_parser"):
        pytest.importorskip(name)
    out = tmp_path_factory.mktemp("api-reference")
    res = subprocess.run([sys.executable, "-c", BUILD, str(DOCS), str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    objects: dict[str, str] = json.loads(res.stdout.strip().splitlines()[-1])["objects"]
    return objects


def resolve(name):
    """The object a dotted name documents, or None."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def public_classes():
    seen = {}
    for modname in PUBLIC_MODULES:
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isclass(obj):
                seen.setdefault(obj, f"{modname}.{name}")
    return seen


def public_functions():
    seen = {}
    for modname in PUBLIC_MODULES:
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, types.FunctionType):
                seen.setdefault(obj, f"{modname}.{name}")
    return seen


def public_methods(cls):
    """(name, defining class) of every public method, property or ``__call__`` of cls."""
    for name in dir(cls):
        if name.startswith("_") and name != "__call__":
            continue
        owner = next(c for c in cls.__mro__ if name in vars(c))
        if owner is object:
            continue
        if isinstance(vars(owner)[name], (types.FunctionType, classmethod, staticmethod,
                                          property)):
            yield name, owner


def documented_names(rendered, kinds):
    """{object: [names it is documented under]} for rendered entries of these kinds."""
    names = {}
    for full, objtype in rendered.items():
        if objtype in kinds:
            obj = resolve(full)
            if obj is not None:
                names.setdefault(obj, []).append(full)
    return names


def missing_entries(rendered):
    classes = documented_names(rendered, {"class", "exception"})
    missing = []
    for cls, public_name in public_classes().items():
        if cls not in classes:
            missing.append(f"class {public_name}")
            continue
        for name, owner in public_methods(cls):
            homes = classes[cls] + (classes.get(owner, []) if owner is not cls else [])
            if not any(f"{home}.{name}" in rendered for home in homes):
                missing.append(f"{public_name}.{name}")
    functions = documented_names(rendered, {"function"})
    missing += [f"function {public_name}" for fn, public_name in public_functions().items()
                if fn not in functions]
    return sorted(missing)


def test_every_public_method_has_a_rendered_entry(rendered):
    missing = missing_entries(rendered)
    assert not missing, "the API reference renders no entry for: " + ", ".join(missing)


def test_a_dropped_entry_is_noticed(rendered):
    """The check itself: remove entries the reference renders and it must see them go."""
    for gone in ("manyheads.MultiHeadAttention.new_cache", "manyheads.models.DecoderModel.generate",
                 "manyheads.KVCache.nbytes"):
        assert gone in rendered, gone
        fewer = {k: v for k, v in rendered.items() if k != gone}
        assert missing_entries(fewer), f"removing {gone} went unnoticed"
