"""Model architectures (one file each) and the safetensors loader."""
