"""Fake of Forge backend/modules/k_model.py's KModel memory estimate, which depends on which function
backend.attention.attention_function is."""

from backend import attention, memory_management


class KModel:
    def __init__(self, computation_dtype):
        self.computation_dtype = computation_dtype

    def memory_required(self, input_shape):
        area = input_shape[0] * input_shape[2] * input_shape[3]
        dtype_size = memory_management.dtype_size(self.computation_dtype)
        if attention.attention_function in [attention.attention_pytorch, attention.attention_xformers]:
            scaler = 1.28
        else:
            scaler = 1.65
            dtype_size = 4
        return scaler * area * dtype_size * 16384
