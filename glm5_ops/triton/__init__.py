"""Triton kernels of glm5_ops (the "triton" backend).

Imported lazily by the Python API (glm5_ops/_backend.py triton_module), so
that importing glm5_ops never needs triton. The differentiable kernels are
the glm5_triton:: ops (same schemas as glm5::), defined with their fakes and
autograd beside the wrappers (glm5_ops/attention.py, glm5_ops/moe.py).
The kernels run on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1
(fp32/fp16 only: the interpreter has no bf16 math). Semantics: glm5_ops/reference.py.
"""
