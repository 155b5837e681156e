"""The dispatch: for each attention call, the kernels or the fallback, and why.

router (the decision, its caches, the counters and the entry points), selftest (the first-use check
of the kernels on a device, whose verdict the router asks for), sdpa_patch (the process-wide override
of torch's scaled_dot_product_attention).
"""
