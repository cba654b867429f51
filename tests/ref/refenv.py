"""refenv.py — where the reference tests find luazero and the packages they
compare it with: the repository, the luazero executable (LUAZERO), and the
virtual environment tools/setup fills (build/ref-venv, or LZ_REF_VENV) for
transformers, tokenizers, tensorboard and the like.
"""
import glob
import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LUAZERO = os.environ.get("LUAZERO") or os.path.join(REPO, "build", "bin", "luazero")
VENV = os.environ.get("LZ_REF_VENV") or os.path.join(REPO, "build", "ref-venv")
# The second environment (torch 2.15, transformers 5.23, peft 0.21.2,
# bitsandbytes 0.50.2), for Gemma 2/3, Qwen3, Mistral's window as 5.x masks
# it, the MoE families: a plain venv, its own torch, kept outside the
# checkout so every clone and CI run shares it. test5_*.py run with its python.
VENV5 = os.environ.get("LZ_REF5_VENV") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "luazero", "ref5-venv")
VERSIONS5 = {"torch": "2.15.0", "transformers": "5.23.0", "peft": "0.21.2",
             "bitsandbytes": "0.50.2"}


def python5():
    """(the second environment's python, None), or (None, why it is absent)."""
    python = os.path.join(VENV5, "bin", "python")
    if not os.access(python, os.X_OK):
        return None, (f"no reference environment 5 at {VENV5} (torch 2.15, transformers 5.23): "
                      "run tools/setup, or set LZ_REF5_VENV")
    return python, None


def import_from_venv(module):
    """(module, None), with the venv's packages first on the path; or (None, why)."""
    for site in glob.glob(os.path.join(VENV, "lib", "python3*", "site-packages")):
        sys.path.insert(0, site)
    try:
        return importlib.import_module(module), None
    except ImportError:
        package = module.split(".")[0]
        return None, (f"cannot import {package} (not in {sys.executable}'s packages nor in "
                      f"{VENV}): pip install {package}, or run tools/setup")


def import_transformers():
    """transformers from the venv, its warnings quiet; None, after a line saying
    the test skips what needs it, when the venv has none."""
    transformers, _ = import_from_venv("transformers")
    if transformers is None:
        print(f"skip: cannot import transformers (not in {VENV}): run tools/setup")
    else:
        transformers.logging.set_verbosity_error()
    return transformers


def require_torch():
    """Ends the test with one failure, saying what to install, when this
    interpreter has no torch or numpy."""
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
        print(f"{name}: cannot import {e.name}: install python3-torch and python3-numpy "
              "(apt-get install python3-torch python3-numpy; tools/setup does it) and run with "
              "/usr/bin/python3")
        print("0 passed, 1 failed")
        sys.exit(1)
