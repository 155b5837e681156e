"""SD-WebUI extension (AUTOMATIC1111, Forge, reForge, Forge Classic, SD.Next): routes the WebUI's
attention to the rdna_flash_attn kernels. scripts/rdna_flash_attn_webui.py loads this package;
`entry.setup()` picks the adapter for the running WebUI. Nothing here raises into the host: a missing GPU, artifact or
host feature leaves the WebUI's own attention in place and says why in one log line.
"""
