"""Models composed from glm5_ops kernels (models/glm5: GLM-5)."""
