"""The CSI v1 messages objfs speaks, described in Python instead of generated code.

The Container Storage Interface is gRPC over protobuf, package ``csi.v1``. On the wire only the
field numbers, types and the service/method names matter, so this module builds a
``FileDescriptorProto`` by hand with exactly those of the specification's ``csi.proto`` for the
messages the node plugin needs, and no others. Fields objfs does not read are still declared
where a kubelet sends them (``publish_context``, ``staging_target_path``, ``readonly``), so that
nothing is silently dropped while parsing; a field left out is skipped by protobuf anyway.

Invariants: every number below is the specification's (checked against csi.proto v1.x:
``NodePublishVolumeRequest`` 1-8, ``VolumeCapability`` {block=1, mount=2 (oneof
access_type), access_mode=3}, ``ProbeResponse.ready`` = ``google.protobuf.BoolValue`` 1, ...);
the messages live in a private descriptor pool, so importing this module never clashes with a
generated ``csi_pb2`` elsewhere in the process. Secrets (``NodePublishVolumeRequest.secrets``,
``MountVolume.mount_flags``) are parsed but never logged by anything in :mod:`objfs.csi`.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

PACKAGE = "csi.v1"

_Field = descriptor_pb2.FieldDescriptorProto
_STRING = _Field.TYPE_STRING
_BOOL = _Field.TYPE_BOOL
_INT64 = _Field.TYPE_INT64
_MESSAGE = _Field.TYPE_MESSAGE
_ENUM = _Field.TYPE_ENUM
_REPEATED = _Field.LABEL_REPEATED
_OPTIONAL = _Field.LABEL_OPTIONAL


def _field(
    message: Any,
    name: str,
    number: int,
    kind: int,
    type_name: str = "",
    *,
    repeated: bool = False,
    oneof: int | None = None,
) -> None:
    field = message.field.add(
        name=name,
        number=number,
        type=kind,
        label=_REPEATED if repeated else _OPTIONAL,
        json_name="".join(
            part if i == 0 else part.capitalize() for i, part in enumerate(name.split("_"))
        ),
    )
    if type_name:
        field.type_name = type_name
    if oneof is not None:
        field.oneof_index = oneof


def _map(message: Any, full_name: str, name: str, number: int) -> None:
    """A ``map<string, string>`` field: a repeated nested ``XxxEntry`` message, as protoc makes."""
    entry_name = "".join(part.capitalize() for part in name.split("_")) + "Entry"
    entry = message.nested_type.add(name=entry_name)
    entry.options.map_entry = True
    _field(entry, "key", 1, _STRING)
    _field(entry, "value", 2, _STRING)
    _field(message, name, number, _MESSAGE, f".{full_name}.{entry_name}", repeated=True)


def _enum(parent: Any, name: str, values: dict[str, int]) -> None:
    enum = parent.enum_type.add(name=name)
    for value_name, number in values.items():
        enum.value.add(name=value_name, number=number)


def _file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(
        name="objfs/csi/csi_v1_subset.proto",
        package=PACKAGE,
        syntax="proto3",
        dependency=["google/protobuf/wrappers.proto"],
    )
    p = f".{PACKAGE}"

    def message(name: str) -> Any:
        return f.message_type.add(name=name)

    # -- Identity ---------------------------------------------------------------------------
    message("GetPluginInfoRequest")
    m = message("GetPluginInfoResponse")
    _field(m, "name", 1, _STRING)
    _field(m, "vendor_version", 2, _STRING)
    _map(m, f"{PACKAGE}.GetPluginInfoResponse", "manifest", 3)

    message("GetPluginCapabilitiesRequest")
    m = message("GetPluginCapabilitiesResponse")
    _field(m, "capabilities", 1, _MESSAGE, f"{p}.PluginCapability", repeated=True)

    m = message("PluginCapability")
    service = m.nested_type.add(name="Service")
    _enum(
        service,
        "Type",
        {
            "UNKNOWN": 0,
            "CONTROLLER_SERVICE": 1,
            "VOLUME_ACCESSIBILITY_CONSTRAINTS": 2,
            "GROUP_CONTROLLER_SERVICE": 3,
        },
    )
    _field(service, "type", 1, _ENUM, f"{p}.PluginCapability.Service.Type")
    m.oneof_decl.add(name="type")
    _field(m, "service", 1, _MESSAGE, f"{p}.PluginCapability.Service", oneof=0)

    message("ProbeRequest")
    m = message("ProbeResponse")
    _field(m, "ready", 1, _MESSAGE, ".google.protobuf.BoolValue")

    # -- Node -------------------------------------------------------------------------------
    m = message("VolumeCapability")
    m.nested_type.add(name="BlockVolume")
    mount = m.nested_type.add(name="MountVolume")
    _field(mount, "fs_type", 1, _STRING)
    _field(mount, "mount_flags", 2, _STRING, repeated=True)
    _field(mount, "volume_mount_group", 3, _STRING)
    access = m.nested_type.add(name="AccessMode")
    _enum(
        access,
        "Mode",
        {
            "UNKNOWN": 0,
            "SINGLE_NODE_WRITER": 1,
            "SINGLE_NODE_READER_ONLY": 2,
            "MULTI_NODE_READER_ONLY": 3,
            "MULTI_NODE_SINGLE_WRITER": 4,
            "MULTI_NODE_MULTI_WRITER": 5,
            "SINGLE_NODE_SINGLE_WRITER": 6,
            "SINGLE_NODE_MULTI_WRITER": 7,
        },
    )
    _field(access, "mode", 1, _ENUM, f"{p}.VolumeCapability.AccessMode.Mode")
    m.oneof_decl.add(name="access_type")
    _field(m, "block", 1, _MESSAGE, f"{p}.VolumeCapability.BlockVolume", oneof=0)
    _field(m, "mount", 2, _MESSAGE, f"{p}.VolumeCapability.MountVolume", oneof=0)
    _field(m, "access_mode", 3, _MESSAGE, f"{p}.VolumeCapability.AccessMode")

    m = message("NodePublishVolumeRequest")
    full = f"{PACKAGE}.NodePublishVolumeRequest"
    _field(m, "volume_id", 1, _STRING)
    _map(m, full, "publish_context", 2)
    _field(m, "staging_target_path", 3, _STRING)
    _field(m, "target_path", 4, _STRING)
    _field(m, "volume_capability", 5, _MESSAGE, f"{p}.VolumeCapability")
    _field(m, "readonly", 6, _BOOL)
    _map(m, full, "secrets", 7)
    _map(m, full, "volume_context", 8)
    message("NodePublishVolumeResponse")

    m = message("NodeUnpublishVolumeRequest")
    _field(m, "volume_id", 1, _STRING)
    _field(m, "target_path", 2, _STRING)
    message("NodeUnpublishVolumeResponse")

    message("NodeGetCapabilitiesRequest")
    m = message("NodeGetCapabilitiesResponse")
    _field(m, "capabilities", 1, _MESSAGE, f"{p}.NodeServiceCapability", repeated=True)
    m = message("NodeServiceCapability")
    rpc = m.nested_type.add(name="RPC")
    _enum(
        rpc,
        "Type",
        {
            "UNKNOWN": 0,
            "STAGE_UNSTAGE_VOLUME": 1,
            "GET_VOLUME_STATS": 2,
            "EXPAND_VOLUME": 3,
            "VOLUME_CONDITION": 4,
            "SINGLE_NODE_MULTI_WRITER": 5,
            "VOLUME_MOUNT_GROUP": 6,
        },
    )
    _field(rpc, "type", 1, _ENUM, f"{p}.NodeServiceCapability.RPC.Type")
    m.oneof_decl.add(name="type")
    _field(m, "rpc", 1, _MESSAGE, f"{p}.NodeServiceCapability.RPC", oneof=0)

    message("NodeGetInfoRequest")
    m = message("NodeGetInfoResponse")
    _field(m, "node_id", 1, _STRING)
    _field(m, "max_volumes_per_node", 2, _INT64)
    return f


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
_POOL.AddSerializedFile(_file().SerializeToString())


def message_class(name: str) -> Any:
    """The message class ``csi.v1.<name>`` (e.g. ``"NodePublishVolumeRequest"``)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


#: service -> method -> (request message, response message): what objfs serves. Every other
#: method of these services (NodeStageVolume, NodeGetVolumeStats, ...) answers UNIMPLEMENTED.
METHODS: dict[str, dict[str, tuple[str, str]]] = {
    "Identity": {
        "GetPluginInfo": ("GetPluginInfoRequest", "GetPluginInfoResponse"),
        "GetPluginCapabilities": ("GetPluginCapabilitiesRequest", "GetPluginCapabilitiesResponse"),
        "Probe": ("ProbeRequest", "ProbeResponse"),
    },
    "Node": {
        "NodePublishVolume": ("NodePublishVolumeRequest", "NodePublishVolumeResponse"),
        "NodeUnpublishVolume": ("NodeUnpublishVolumeRequest", "NodeUnpublishVolumeResponse"),
        "NodeGetCapabilities": ("NodeGetCapabilitiesRequest", "NodeGetCapabilitiesResponse"),
        "NodeGetInfo": ("NodeGetInfoRequest", "NodeGetInfoResponse"),
    },
}


def generic_handlers(implementations: dict[str, dict[str, Any]]) -> list[Any]:
    """gRPC handlers for ``{service: {method: callable(request, context) -> response}}``."""
    handlers = []
    for service, methods in implementations.items():
        table = {}
        for method, function in methods.items():
            request_name, _response_name = METHODS[service][method]
            table[method] = grpc.unary_unary_rpc_method_handler(
                function,
                request_deserializer=message_class(request_name).FromString,
                response_serializer=lambda response: response.SerializeToString(),
            )
        handlers.append(grpc.method_handlers_generic_handler(f"{PACKAGE}.{service}", table))
    return handlers


class Client:
    """A CSI client over a Unix socket, as a kubelet would call (tests use it as one).

    ``client.call("Node", "NodePublishVolume", volume_id=..., ...)`` builds the request from
    keyword arguments and returns the response message; failures raise ``grpc.RpcError`` with
    ``.code()`` and ``.details()``.
    """

    def __init__(self, endpoint: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)

    def call(self, service: str, method: str, timeout_s: float = 30.0, /, **fields: Any) -> Any:
        request_name, response_name = METHODS[service][method]
        stub = self.channel.unary_unary(
            f"/{PACKAGE}.{service}/{method}",
            request_serializer=lambda request: request.SerializeToString(),
            response_deserializer=message_class(response_name).FromString,
        )
        return stub(message_class(request_name)(**fields), timeout=timeout_s)

    def call_raw(self, service: str, method: str, timeout_s: float = 30.0) -> Any:
        """Calls a method objfs may not implement, with an empty request: returns raw bytes."""
        stub = self.channel.unary_unary(
            f"/{PACKAGE}.{service}/{method}",
            request_serializer=lambda request: request,
            response_deserializer=lambda data: data,
        )
        return stub(b"", timeout=timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
