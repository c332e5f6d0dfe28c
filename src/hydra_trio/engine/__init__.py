"""Inference: the llama.cpp backend (the only module importing llama_cpp), the GPU worker,
slots, sampling and the chat template."""
