"""Benchmarks of the decode step on a slice of GLM-5.3-Flash (layers 0-7 at real widths).

`slice` builds the slice with random weights in the checkpoint's dtypes and a
random prior context; `floor` measures the read bandwidth and counts the bytes
a step must move; `stock` times the stock runtime (eager and CUDA graphs) and
the engine end to end; `specialized` the specialized executor against it;
`speculative` MTP verify steps, drafting and tokens/s at assumed acceptance;
`cli` is the `glm5next bench` sub-command.
"""
