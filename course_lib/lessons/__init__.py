"""The notebooks' own helpers: code that a notebook uses to show or measure something, which the training loop, the
ladder, the exporter and the panels never use. The library the loop uses is the rest of course_lib; nothing there
imports from here.

- `training_compute` (01, 02, 09): C = 6ND, PF-days, time to train, and what checkpointing's recompute costs.
- `hardware` (01, 03): the GPU generations' formats, and the matmul shapes of the course's model.
- `formula_beside_measured` (01, 02, 09): the memory formula beside a measurement (a table, the panels' runner) and
  one step accounted by the ledger under FakeTensorMode.
- `memory_calculator` (02): the paper's activation formula (Korthikanti et al.) and the will-it-fit calculator's config.
- `memory_plots` (02): will-it-fit and the step's memory timeline, drawn.
- `number_formats` (03): the formats side by side, the dtype autocast gives each op, fp16 underflow and loss
  scaling, error against fp64, why master weights; 03's panel runner.
- `pure_bf16` (03): training with weights, gradients and AdamW's state all in bf16; stochastic rounding, Kahan sums.
- `attention_by_hand` (04): tiled (flash-style) and windowed attention in plain PyTorch, FlashAttention-2's forward
  and backward as an `autograd.Function` (`flash_attention`), which SDPA backend runs, the context-length sweep.
- `micro_benchmarks` (04): timing and peak memory of one call, "ugly" sizes, AdamW's implementations, what
  torch.compile does when shapes change.
- `device_timeline` (04): a profiled step's kernels on the device's time line (launch-bound or not).
- `flash_attention_triton` (04): FlashAttention's forward written in Triton, and its benchmark.
- `optimizers_by_hand` (05): AdamW, AdaGrad and RMSProp written from their update rules and checked against torch's;
  schedules, clipping and optimizer state bytes, measured.
- `accumulated_gradients` (06): the big batch's arithmetic, the accumulated gradient under each normalisation, the
  padding trap.
- `communication` (07): the collectives benchmark's table, JSON and plot, its alpha-beta fit, the naive DDP's predicted
  communication; the hand-written DDPs' step time, exposed communication and bucket sweep, drawn.
- `ladder_diffs` (09): each kept rung's change to the exported script, beside what it measured.
- `kernel_floor` (09, `python -m course_lib profile`): each matmul and fused attention of a profiled step timed
  again by itself: how fast the step could be while it calls them.
- `fresh_processes` (02): a process-wide setting (keeping freed memory) timed in fresh processes taking turns.

A notebook may borrow from another's helper rather than write it twice (05 reads `number_formats.tensor_kind`;
`pure_bf16`'s optimizer is `optimizers_by_hand`'s AdamW). Each is tested: most in a test file named after it, the rest
with their notebook's subject.
"""
