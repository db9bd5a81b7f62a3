"""An OpenAI-compatible API over dockrl's engines: request shapes and rendering (openai_api.py), the HTTP app
(server.py) and `dockrl serve`'s engine loop (engine_loop.py). No Ray."""
