"""The names of a bundle's files and folders: the one place they are spelled. Every other module
(the exporter that writes them, the runtime and the Triton writer that read them) imports them."""
from __future__ import annotations

MANIFEST = "manifest.json"  # the sealed record of everything else
CONFIG = "config.json"  # the checkpoint's, copied
TOKENIZER = "tokenizer.json"  # the checkpoint's, copied
# The checkpoint's tokenizer and sentence-transformers files, copied beside them when present.
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = "special_tokens_map.json"
ST_MODULES = "modules.json"  # the module list (the Pooling module's folder)
ST_CONFIG = "sentence_bert_config.json"  # max_seq_length
ST_MODEL_CONFIG = "config_sentence_transformers.json"  # prompts, similarity function
FP32_GRAPH = "model.onnx"  # ONNX Runtime's form (fused attention)
FP16_GRAPH = "model.fp16.onnx"  # the mixed-precision graph, TensorRT's form
INT8_GRAPH = "model.int8.onnx"  # dynamic INT8 for ONNX Runtime CPU (--int8)
PLAN = "model.plan"  # the TensorRT engine
BUILD_LOG = "tensorrt_build.log"
PRECISION_WALK = "tensorrt_precision.json"  # the FP16 plan checked in TensorRT's network
FP16_PLAN = "precision.json"  # the FP16 scan and plan
FP16_PLOT = "precision.png"
INT8_PLAN = "int8.json"
INT8_PLOT = "int8.png"
TRITON = "triton"  # the Triton model repository
TRITON_PENDING = "triton_pending"  # Triton models waiting for an engine (outside the repository)
# The encoders of a bundle's Triton repository (model ``<name>_<encoder>``), which its ensemble can route
# to: ONNX Runtime inside the Python backend, Triton's ONNX Runtime backend, the TensorRT plan.
TRITON_ENCODERS = ("python", "onnx", "trt")
# The files Triton looks for in a model's folder: its configuration, and in the version folder ``1/``
# the file its backend loads by default (ONNX Runtime, TensorRT, Python).
TRITON_CONFIG = "config.pbtxt"
TRITON_ONNX = "model.onnx"
TRITON_PLAN = "model.plan"
TRITON_PYTHON = "model.py"
