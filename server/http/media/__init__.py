"""Images in chat requests: fetched under the server's limits (`fetch`, `address_guard`), decoded
and preprocessed off the event loop, and turned into the engine's prompt (`intake`)."""
