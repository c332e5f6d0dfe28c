"""llama.cpp through llama-cpp-python's low-level API: the only package that imports
llama_cpp. log.py routes its log; chat.py its built-in chat templates; devices.py the ggml
devices, offload and repacking; sampling.py a request's sampler; context.py the model and
its context (decode, steps, tokens); state.py a slot's KV state out and in; seqstate.py that
state's layout, read without llama.cpp."""
