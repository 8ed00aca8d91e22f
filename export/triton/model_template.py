"""Triton Python-backend model of an mbert-export bundle.

mbert-export copies this file to ``<name>_tokenizer/1/model.py`` and ``<name>_python/1/model.py``
of the bundle's Triton repository and never imports it. The code lives in
``mbert.runtime.serve.models``; the model's ``role`` parameter (config.pbtxt) picks the tokenizer
or the ONNX Runtime encoder. Triton's Python environment must have mbert-export installed: it has
under ``mbert-run serve``; in NVIDIA's Triton containers run ``pip install 'mbert-export[cpu]'``.
"""
from mbert.runtime.serve.models import TritonPythonModel  # noqa: F401
