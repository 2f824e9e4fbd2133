"""`kgen selftest`: the one run that shows kgen working on a machine. Every bundled spec built and
verified on the device, the GPU tests, decode and prefill timed against FlashInfer and torch SDPA,
the vLLM comparison; REPORT.md and selftest.json with every figure, the device and the versions.

steps.py lists the steps (each with its time budget on one H100/H200), runner.py runs each in its
own process within its budget, report.py writes the report; the steps themselves live in
environment.py, specs.py, timing.py and external.py."""
