"""Import paths that moved, kept for one release: importing an old path warns (DeprecationWarning, naming
the new path) and gives the module at the new path itself, so its classes and state are the same objects."""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

E = "pagedkv.engine"
MOVED = {
    f"{E}.llama": f"{E}.models.llama", f"{E}.gemma2": f"{E}.models.gemma2",
    f"{E}.loader": f"{E}.checkpoints.loader", f"{E}.gguf": f"{E}.checkpoints.gguf",
    f"{E}.chat": f"{E}.checkpoints.chat",
    f"{E}.disk_tier": f"{E}.kv.disk_tier", f"{E}.kv_events": f"{E}.kv.events",
    f"{E}.kv_identity": f"{E}.kv.identity", f"{E}.kv_quant": f"{E}.kv.quant",
    f"{E}.kv_transfer": f"{E}.kv.transfer",
    f"{E}.llm_engine": f"{E}.serving.llm_engine", f"{E}.scheduler": f"{E}.serving.scheduler",
    f"{E}.sequence": f"{E}.serving.sequence", f"{E}.sampling": f"{E}.serving.sampling",
    f"{E}.speculative": f"{E}.serving.speculative", f"{E}.metrics": f"{E}.serving.metrics",
    f"{E}.model_runner": f"{E}.execution.model_runner", f"{E}.cpu_linear": f"{E}.execution.cpu_linear",
    f"{E}.worker": f"{E}.tp.worker",
    "pagedkv.simulate": "pagedkv.demo.simulate", "pagedkv.chat_workload": "pagedkv.demo.chat_workload",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of MOVED; loading one imports the new module and serves it under the old name."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes away in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        # The import machinery set the old name's spec on the module: give it back its own.
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, module.__loader__,
                                                         origin=module.__file__)
        module.__spec__.has_location = True


def install() -> None:
    if not any(isinstance(f, _MovedModule) for f in sys.meta_path):
        sys.meta_path.append(_MovedModule())
