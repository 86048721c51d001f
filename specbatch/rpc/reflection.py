"""gRPC server reflection, v1 beside v1alpha.

grpcio-reflection (1.85) serves only ``grpc.reflection.v1alpha.ServerReflection``; clients that
ask for ``grpc.reflection.v1.ServerReflection`` (newer grpcurl, Postman, grpcui) get
UNIMPLEMENTED. v1 is v1alpha under another package name: the same messages with the same field
numbers, so the same bytes on the wire. So v1 is served by the v1alpha servicer itself under the
v1 name, and the v1 file descriptor (v1alpha's, renamed) joins the default descriptor pool, so
that reflection can describe its own v1 service too.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


def register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(V1_FILE)
        return  # already there (another library registered it)
    except KeyError:
        pass
    alpha = reflection_pb2.DESCRIPTOR
    proto = descriptor_pb2.FileDescriptorProto.FromString(alpha.serialized_pb)
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.options.Clear()
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    proto.options.java_multiple_files = True
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    old, new = f".{alpha.package}.", f".{V1_PACKAGE}."
    for message in proto.message_type:
        for item in message.field:
            if item.type_name:  # assigning "" would mark a scalar field as typed
                item.type_name = item.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.Add(proto)


def enable_server_reflection(service_names, server: grpc.Server) -> None:
    """Serve reflection v1alpha and v1 on ``server`` for ``service_names`` (which should name
    both reflection services, ``SERVICE_NAMES``)."""
    pool = descriptor_pool.Default()
    register_v1_descriptor(pool)
    servicer = reflection.ReflectionServicer(service_names, pool=pool)
    reflection.enable_server_reflection(service_names, server, pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": handler}),))
