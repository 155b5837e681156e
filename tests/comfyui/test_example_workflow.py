"""examples/comfyui_workflow.json is a valid ComfyUI API-format prompt for the loaded nodes."""

from __future__ import annotations

import json

from rdna_fa_lab.hosts.comfyui_harness import REPO_ROOT

FILE_INPUTS = {"ckpt_name"}  # names of model files a user has, not known here


def test_every_node_and_input_exists(node_package):
    import nodes as comfy_nodes

    workflow = json.loads((REPO_ROOT / "examples" / "comfyui_workflow.json").read_text())
    used = set()
    for node_id, node in workflow.items():
        node_class = comfy_nodes.NODE_CLASS_MAPPINGS[node["class_type"]]
        declared = node_class.INPUT_TYPES()
        spec = {**declared.get("required", {}), **declared.get("optional", {})}
        assert set(declared.get("required", {})) <= set(node["inputs"]), node_id
        for name, value in node["inputs"].items():
            assert name in spec, (node_id, name)
            kind = spec[name][0]
            if isinstance(value, list):  # a link: [source node, output index]
                source = comfy_nodes.NODE_CLASS_MAPPINGS[workflow[value[0]]["class_type"]]
                assert source.RETURN_TYPES[value[1]] == kind, (node_id, name)
            elif isinstance(kind, list) and name not in FILE_INPUTS:
                assert value in kind, (node_id, name, value)
        used.add(node["class_type"])
    assert {"RDNAFlashAttentionModel", "RDNAFlashAttentionVAE"} <= used
