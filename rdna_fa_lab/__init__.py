"""The repository's lab: what checks, measures and shows the kernels without being installed with
them. It runs from a clone of the repository (`python -m rdna_fa_lab VERB`), uses the package
(rdna_flash_attn) like any caller, and the package never imports it.

    interpreter           a CPU interpreter of the RDNA ISA that runs the shipped code objects
    interpreted           a Stable Diffusion attention call and the self-test's checks on it
    interpreted_bench     `bench`: the main job (the package's benchmark where the kernels run; else the
                          code objects on the interpreter and the expected speed per RDNA GPU)
    interpreted_selftest  `selftest`: the self-test on the interpreter
    expected_speed        the expected speed per RDNA GPU (expected_speed.json), as text and plots
    throughput_estimate   the static estimator those figures come from: the pipe model, the reading
                          of the disassembly, the forward and the 8-bit forward; beside it
                          backward_throughput_estimate and masked_throughput_estimate (bench's
                          estimate_*.py scripts print and record them)
    resource_report       `report`: the static resource report of the code objects
    coverage, hosts       `coverage`: the share of each model family's attention the kernels take in
                          ComfyUI, the WebUIs, diffusers and sd-scripts, measured on their own code
    attention_reference   the float64 reference and error yardsticks of the GPU tests and studies

Its needs beyond the package's are in requirements.txt.
"""
