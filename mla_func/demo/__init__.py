"""The demo model: a small DeepSeek-V3-architecture model that ships with mla-func.

`mla_func.load_model("demo")` loads it from `MODEL_DIR` (with `mtp=True`, its
multi-token-prediction layer too, the drafter of speculative decoding). It was
trained by `python -m mla_func.demo.train` (see `model/TRAINING.md`) with
mla-func's own pure forward under `torch.func`, on the docstrings of Python's
standard library.
"""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"

__all__ = ["MODEL_DIR"]
