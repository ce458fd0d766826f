"""Patches into serving engines (vLLM, SGLang), version-gated.

This is the only part of kvcached that imports an engine. Every engine module is
imported lazily, inside the patch that needs it: importing this package (or a
subpackage) never imports torch, vLLM or SGLang.
"""
