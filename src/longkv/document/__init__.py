"""A long document read once and asked many questions: `read`, `Document.ask`, and a read kept
on disk (`save`, `load`)."""

from longkv.document.read import METHODS, Answer, Document, ReadSettings, read

__all__ = ["METHODS", "Answer", "Document", "ReadSettings", "read"]
