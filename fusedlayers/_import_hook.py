"""Import hooks: run code around the first import of a module, without importing it now (a
framework costs seconds to import, and fusedlayers imports none of its own accord)."""

import importlib.abc
import importlib.util
import sys


class _AroundImport(importlib.abc.MetaPathFinder):
    """Finds `name` through the rest of sys.meta_path and has `wrap(exec_module, module)` execute
    it; leaves sys.meta_path when it does. A lookup that imports nothing
    (importlib.util.find_spec) leaves it in place for the import that follows."""

    def __init__(self, name, wrap):
        self.name, self.wrap = name, wrap

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        else:
            return None
        if spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def execute(module):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.wrap(exec_module, module)
        spec.loader.exec_module = execute
        return spec


def around_import(name: str, wrap) -> None:
    """Has `wrap(exec_module, module)` execute module `name` (by calling exec_module(module)) when
    it is first imported; nothing if it is imported already."""
    if name not in sys.modules and not any(
            isinstance(f, _AroundImport) and (f.name, f.wrap) == (name, wrap)
            for f in sys.meta_path):
        sys.meta_path.insert(0, _AroundImport(name, wrap))


def after_import(name: str, callback) -> None:
    """Calls callback(module) once module `name` is imported: now if it is already, else right
    after its first import."""
    if name in sys.modules:
        callback(sys.modules[name])
        return

    def then(exec_module, module):
        exec_module(module)
        callback(module)
    around_import(name, then)
