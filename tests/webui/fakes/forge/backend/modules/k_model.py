"""Fake of Forge backend/modules/k_model.py's memory estimate, which depends on which function
backend.attention.attention_function is."""

from backend import attention, memory_management


def memory_required(input_shape, computation_dtype):
    area = input_shape[0] * input_shape[2] * input_shape[3]
    dtype_size = memory_management.dtype_size(computation_dtype)
    if attention.attention_function in [attention.attention_pytorch, attention.attention_xformers]:
        scaler = 1.28
    else:
        scaler = 1.65
        dtype_size = 4
    return scaler * area * dtype_size * 16384
