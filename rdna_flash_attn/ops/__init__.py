"""The kernels as torch ops: attention (the checks that keep bad input off the GPU, and the launches),
launch_args (the kernels' argument blocks), autograd (the differentiable op, a torch.library custom op
where torch has them, and the packed variable-length one)."""
