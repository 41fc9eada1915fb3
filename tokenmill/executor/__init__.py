"""How the engine reaches its worker(s): in this process, or in child processes that
receive each step as plain data (tokenmill.core.step)."""
