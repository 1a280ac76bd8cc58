"""`longkv serve`: an OpenAI-compatible server over kept reads.

A request's prompt is split in two (`serve.prompt`): the context (a document, earlier turns),
read once and kept (`serve.kept`), and the rest (the question), read on a fork of the kept read
for each request (`Document.answer`). A request whose context begins with a kept read's tokens
continues that read (`Document.extend`), so a second question about a document costs only the
question. One worker runs the model, one request at a time (`serve.worker`); the HTTP side
(`serve.app`, Starlette under uvicorn) queues requests, streams answers and answers errors in
OpenAI's shape (`serve.api`).
"""
