"""What makes megatron-core run here without patching its model code: ``versions`` (the
supported megatron-core range and the API differences between its releases) and
``cpu_shim`` (the torch.cuda calls megatron-core makes, answered on CPU-only machines).

Imported by the rest of ``actor`` only; ``tools/ci_mcore_matrix.sh`` reads ``versions``.
"""
