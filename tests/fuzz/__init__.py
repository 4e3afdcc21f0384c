"""Property-based fuzzing of every glm5_ops op, every raw torch.ops.glm5 schema
and the GLM-5 model's entry points. docs/FUZZING.md explains how to run it,
what a case is and how to add an op."""
