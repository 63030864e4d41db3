"""Real-vLLM tier: the agent against a real vLLM (CPU build) serving a small embedding model.

Skipped unless RUNTIME_AGENT_REAL_VLLM=1; ``scripts/realvllm.sh`` sets it up and runs it.
"""
