// Argument checks shared by the C++ kernels. The Python API checks first and
// names the argument; these guard direct torch.ops.glm5 calls.
#pragma once

#include <ATen/ATen.h>

#define GLM5_CHECK_RANK(t, r, name, shape)                                                     \
  TORCH_CHECK((t).dim() == (r), name " must have shape " shape ", got a tensor of rank ", \
              (t).dim())
#define GLM5_CHECK_FLOAT(t, name)                                                              \
  TORCH_CHECK(at::isFloatingType((t).scalar_type()), name " must be fp32, fp16 or bf16, got ", \
              (t).scalar_type())
