"""ROCm code generation helpers (AMDGPU: 64-lane wavefronts, MFMA)."""
