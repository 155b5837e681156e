"""The hosts the coverage benchmark and the host tests run in this process, each from its own code:
ComfyUI (comfyui_harness, which also puts a host's folder on sys.path), A1111's ldm and sgm, Forge /
reForge / Forge Classic, SD.Next, diffusers and kohya sd-scripts; host_code is what several share."""
