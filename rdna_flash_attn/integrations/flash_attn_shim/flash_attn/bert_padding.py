"""`flash_attn.bert_padding` of the stand-in: rdna_flash_attn.integrations.bert_padding."""

from rdna_flash_attn.integrations.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]
