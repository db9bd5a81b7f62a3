"""Environments for multi-turn rollout: the interface (base.py), tool-call parsing (tool_calls.py), built-in
tools (tools.py: calculator, sandboxed python), the built-in tool environment (tool_env.py) and how a config's
`env.name` becomes an environment (loader.py). Pure python: no torch, no Ray."""
