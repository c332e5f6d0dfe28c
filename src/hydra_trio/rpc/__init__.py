"""Binary RPC transport: server (connection loop + op dispatch) and client (trio + sync)."""
