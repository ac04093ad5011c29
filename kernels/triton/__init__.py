"""Triton kernels for tessera (attention, RMSNorm, rotary).

Importing any module here imports triton, so the rest of tessera reaches these modules only
lazily (for example through `create_attention_backend("triton")`). On a CPU machine the kernels
run in Triton's interpreter, which needs TRITON_INTERPRET=1 set before triton is imported.
"""
