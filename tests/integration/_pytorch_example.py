"""The PyTorch example's task module, importable by the integration test (examples/ is not a package)."""
import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "pytorchexample" / "task.py"
_spec = importlib.util.spec_from_file_location("pytorchexample_task_for_tests", _path)
assert _spec is not None and _spec.loader is not None
_mod = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _mod
_spec.loader.exec_module(_mod)
Net = _mod.Net
load_centralized_dataset = _mod.load_centralized_dataset
