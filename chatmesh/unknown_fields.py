"""Finding fields a request carries that this build's protos do not define.

Protobuf keeps the fields a parser does not know and lets the code that reads the message never see
them, so a client built from newer protos would have its new fields silently ignored. A service refuses
such a request instead (INVALID_ARGUMENT naming where the field is), as the HTTP door refuses an unknown
JSON field.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet


def unknown_field(message: Message, path: str = "") -> tuple[str, int] | None:
    """(where, field number) of the first field in ``message`` that its type does not define, at any
    depth (``where`` is the enclosing field's path, "" for the top level); None if there is none."""
    found = UnknownFieldSet(message)
    if len(found):
        return path, found[0].field_number
    for field, value in message.ListFields():
        entry = field.message_type
        if entry is None:  # a scalar
            continue
        name = f"{path}.{field.name}" if path else field.name
        if entry.GetOptions().map_entry:
            if entry.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                items = [(f"{name}[{key!r}]", item) for key, item in value.items()]
            else:
                items = []
        elif field.is_repeated:
            items = [(f"{name}[{i}]", item) for i, item in enumerate(value)]
        else:
            items = [(name, value)]
        for where, item in items:
            if (inner := unknown_field(item, where)) is not None:
                return inner
    return None
