"""mbert.export: checkpoint -> validated ONNX bundle -> mixed-precision ONNX -> TensorRT engine.

Small composable steps (heavy imports happen inside them, so importing this package is cheap)::

    from mbert.modeling import load_model, load_pooling
    from mbert.export.onnx.trace import to_onnx
    from mbert.export.fp16.precision import scan, plan, to_mixed_precision
    from mbert.export.tensorrt.build import build_engine        # TensorRT or TensorRT-RTX
    from mbert.export.tensorrt.precision import walk_precision  # the plan checked in TensorRT's network
    from mbert.bundle.validation import compare

``mbert.export.pipeline.export_bundle`` sequences them; ``mbert-export`` is its command line.
"""
__version__ = "0.1.0"
