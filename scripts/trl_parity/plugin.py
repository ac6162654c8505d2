"""pytest plugin for `run.py`: serve `load_dataset("trl-internal-testing/...")` from the rebuilt parquet files.

Models need no patch (`build_fixtures.py` writes them as a Hub cache that `HF_HUB_OFFLINE=1` reads). Datasets do:
offline, `datasets` cannot resolve a Hub dataset id from files alone, so this plugin wraps `datasets.load_dataset`
before TRL's test module is imported (`-p plugin`); every other call goes through unchanged. A dataset id or
config that was not rebuilt raises `FileNotFoundError` naming it.

TRL's `tests/testing_utils.py` of mid-2026 imports `trl.import_utils.is_joblib_available`, which the installed
TRL 1.16 lacks; it is added here (a `find_spec` check, as TRL's own) when missing. Nothing else is patched.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import datasets
import trl.import_utils  # noqa: F401  (the module, from sys.modules: trl is a lazy module)

_original = datasets.load_dataset
_ROOT = Path(os.environ.get("TRL_PARITY_FIXTURES", "")) / "datasets"


def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    if not (isinstance(path, str) and path.startswith("trl-internal-testing/")):
        return _original(path, name, *args, split=split, streaming=streaming, **kwargs)
    folder = _ROOT / path.split("/", 1)[1] / (name or "")
    if not folder.is_dir():
        raise FileNotFoundError(f"{path} {name}: not rebuilt by scripts/trl_parity/build_fixtures.py")
    files = {p.stem: str(p) for p in sorted(folder.glob("*.parquet"))}
    return _original("parquet", data_files=files, split=split, streaming=streaming)


datasets.load_dataset = load_dataset

_import_utils = sys.modules["trl.import_utils"]
if not hasattr(_import_utils, "is_joblib_available"):
    _import_utils.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None
