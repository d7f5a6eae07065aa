"""The ``usage_facts`` table's columns: one row per priced model call, written by whoever made the call (the
proxy's analytics recorder for chats, the memory stage for fact extraction) and read by ``/v1/usage``."""

USAGE_COLUMNS = ("org_id", "agent_id", "request_id", "ts", "model", "prompt_tokens", "completion_tokens", "cost_usd")
