"""Triton kernels of glm5_ops (the "triton" backend).

Imported lazily by the Python API (glm5_ops/indexer.py), so that importing
glm5_ops never needs triton. The kernels run on CUDA tensors, and on CPU
tensors under TRITON_INTERPRET=1 (fp32/fp16 only: the interpreter has no
bf16 math). Semantics: glm5_ops/reference.py.
"""
