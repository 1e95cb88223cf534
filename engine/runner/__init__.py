"""The model runner: lays a step out (step_layout), runs the forward (CUDA graphs
where captured), collects the step's output; the device, pooling, weights."""
