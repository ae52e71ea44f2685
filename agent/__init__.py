"""Multi-turn rollouts with tools (verl's agent loop): the parts the rollouter's loops and the
trainer's prompt rendering share, none of which knows Redis or an engine.

- :mod:`agent.tool`: the tool interface (verl's ``BaseTool`` shape) and one call's outcome;
- :mod:`agent.toolcall`: tool calls parsed from an assistant turn's text (verl's ``hermes``);
- :mod:`agent.toolbox`: the run's tools called off the rollouter's event loop and engine
  thread, each call bounded in time and never raising;
- :mod:`agent.toolconfig`, :mod:`agent.functiontool`: the tools loaded as verl configures
  them (``multi_turn.tool_config_path``; ``function_tool_path`` and ``@function_tool``);
- :mod:`agent.sandbox`, :mod:`agent.sandbox_fusion`, :mod:`agent.calculator`: the built-in
  tools (a Python code interpreter in a sandboxed process pool, or a SandboxFusion service;
  a calculator);
- :mod:`agent.conversation`: one response as a conversation of assistant and tool turns,
  folded turn by turn into the tokens, the loss mask and the versions a sample carries.
"""
