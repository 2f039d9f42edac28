"""OPC UA server (asyncua, pinned) with an address space modelled on OPC 40100-1 (Machine Vision).

The node tree (namespace :data:`NAMESPACE`; docs/plc.md has it with types)::

    Objects/VisionSystem                       emits ResultReadyEventType (every station)
      VisionStateMachine/CurrentState          Preoperational | Operational | Halted | Error
      VisionStateMachine/AutomaticModeStateMachine/CurrentState   Ready while Operational
      Status/Ready, Heartbeat, HeartbeatCount, Fault, FaultReason
      RecipeManagement/Recipes                 the served model:version list
      ResultManagement/Station<N>              emits ResultReadyEventType (its results)
        CameraId, Busy, ResultCount
        Trigger(PartId) -> Result                acquire and inspect: the verdict is a result
        LastResult/ResultId, Sequence, PartId, ResultState, ResultCode, Reason, ReasonText,
                   Verdict, Label, LabelIndex, Score, Model, ModelVersion, FrameIndex,
                   CreationTime, ProcessingTimes/{StartTime, EndTime, QueueDuration,
                   ProcessingDuration, TotalDuration}

40100 models a result as structures (ResultDataType, ProcessingTimesDataType); here they are
flattened into scalar variables and event fields with the same names, which any PLC's OPC UA
client reads without custom type support. Every node is read-only to clients (a write gets the
protocol's own Bad status).

Security: anonymous access only when enabled; user name and password; endpoints for the
policies asked for (Basic256Sha256, Aes128Sha256RsaOaep, each Sign and SignAndEncrypt; None only
when named). The server's certificate and key are made on first start in the data folder and
kept (a PLC trusts that certificate; a new one each start would break the connection). Client
application certificates: when ``<data>/opcua/trusted`` holds certificates, only those are
accepted and others are copied to ``<data>/opcua/rejected`` for the administrator to move over,
the usual OPC UA PKI workflow; an empty folder accepts every client certificate (a warning says
so).

A secure channel with security None is always open for discovery (GetEndpoints, FindServers: a
client learns the server's certificate that way), but a session is only created or activated on
a channel whose policy and mode are among those offered (:class:`_Processor`): a client that
skips its own endpoint check cannot open one unsecured, nor send its password in plain text.
Connections without an activated session give their slot to a new client when all are taken
and are closed after ``--plc-idle-timeout-s`` (:mod:`.slots`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import hmac
import json
import logging
import math
import os
import socket
import time
from collections import deque
from pathlib import Path

from asyncua import Server, ua
from asyncua.common.utils import ServiceError
from asyncua.crypto import cert_gen, uacrypto
from asyncua.crypto.permission_rules import User, UserRole
from asyncua.server.binary_server_asyncio import BinaryServer, OPCUAProtocol
from asyncua.server.event_generator import EventGenerator
from asyncua.server.uaprocessor import UaProcessor
from asyncua.server.user_managers import UserManager
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID

from ..errors import ConfigError, VisionServeError
from . import metrics, slots
from .bus import RESULT_STATE, RESULT_STATE_FAILED, ResultCode, ResultEvent, Stations
from .handshake import LineStatus
from .watchdog import SystemState

log = logging.getLogger(__name__)

NAMESPACE = "urn:visionserve:machinevision"
STATE_NAMES = {SystemState.PREOPERATIONAL: "Preoperational", SystemState.OPERATIONAL: "Operational",
               SystemState.HALTED: "Halted", SystemState.ERROR: "Error"}
POLICIES = {
    "None": [ua.SecurityPolicyType.NoSecurity],
    "Basic256Sha256": [ua.SecurityPolicyType.Basic256Sha256_SignAndEncrypt,
                       ua.SecurityPolicyType.Basic256Sha256_Sign],
    "Aes128Sha256RsaOaep": [ua.SecurityPolicyType.Aes128Sha256RsaOaep_SignAndEncrypt,
                            ua.SecurityPolicyType.Aes128Sha256RsaOaep_Sign],
}
CERT_DAYS = 3650  # a PLC trusts this certificate: it should outlive the line's commissioning

_S, _I, _U, _D, _B, _T = (ua.VariantType.String, ua.VariantType.Int32, ua.VariantType.UInt32,
                          ua.VariantType.Double, ua.VariantType.Boolean, ua.VariantType.DateTime)
#: LastResult variables = ResultReadyEventType fields (besides Station and CameraId), with types
RESULT_FIELDS = (("ResultId", _S), ("Sequence", _U), ("PartId", _S), ("ResultState", _I),
                 ("ResultCode", _I), ("Reason", _I), ("ReasonText", _S), ("Verdict", _S),
                 ("Label", _S), ("LabelIndex", _I), ("Score", _D), ("Model", _S),
                 ("ModelVersion", _S), ("FrameIndex", _I), ("CreationTime", _T))
TIME_FIELDS = (("StartTime", _T), ("EndTime", _T), ("QueueDuration", _D),
               ("ProcessingDuration", _D), ("TotalDuration", _D))
#: ResultReadyEventType's own fields: what a PLC acts on. asyncua encodes every selected field of
#: every event in Python, so the event stays lean; the times are in LastResult (and the event's
#: Time)
EVENT_FIELDS = tuple((n, t) for n, t in RESULT_FIELDS + TIME_FIELDS
                     if n not in ("ReasonText", "FrameIndex", "CreationTime", "StartTime",
                                  "EndTime", "QueueDuration", "ProcessingDuration")) \
    + (("Station", _S), ("CameraId", _S))
_SEVERITY = {ResultCode.OK: 100, ResultCode.NG: 500, ResultCode.NO_DECISION: 800}


def parse_policies(spec: str) -> list:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if not names or unknown:
        raise ConfigError(f"--opcua-security {spec!r}: use one or more of {', '.join(POLICIES)}")
    return [p for n in names for p in POLICIES[n]]


def read_password(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(
            f"--opcua-password-file {path}: cannot read: {exc.strerror or exc}") from None


class _Users(UserManager):
    """Who may open a session: the one configured user, and anonymous clients when enabled."""

    def __init__(self, anonymous: bool, user: str | None, password: str | None) -> None:
        self.anonymous = anonymous
        self.user = user
        self.password = (password or "").encode()
        self._refused: set[str] = set()

    def get_user(self, iserver, username=None, password=None, certificate=None):
        if username is None and certificate is None:
            return User(role=UserRole.User, name="anonymous") if self.anonymous else None
        if (self.user is not None and username is not None
                and hmac.compare_digest(username.encode(), self.user.encode())
                and hmac.compare_digest(str(password or "").encode(), self.password)):
            return User(role=UserRole.User, name=username)
        who = "a client certificate" if username is None else f"user {username!r}"
        if who not in self._refused:  # once per user name: a PLC retrying must not flood the log
            self._refused.add(who)
            log.warning("OPC UA: refused %s (unknown user or wrong password)", who)
        return None


class _TrustList:
    """Client application certificates: trusted ones in ``trusted/``, refused ones kept in
    ``rejected/`` so an administrator can trust them by moving the file."""

    def __init__(self, folder: Path) -> None:
        self.trusted_dir = folder / "trusted"
        self.rejected_dir = folder / "rejected"
        for d in (self.trusted_dir, self.rejected_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.trusted: set[bytes] = set()
        for f in sorted(self.trusted_dir.iterdir()):
            try:
                data = f.read_bytes()
                cert = (x509.load_pem_x509_certificate(data) if data.lstrip().startswith(b"-----")
                        else x509.load_der_x509_certificate(data))
            except (OSError, ValueError) as exc:
                log.warning("OPC UA: %s is not a certificate (%s); ignored", f, exc)
                continue
            self.trusted.add(cert.public_bytes(Encoding.DER))

    async def validate(self, cert: x509.Certificate, app) -> None:
        der = cert.public_bytes(Encoding.DER)
        if der in self.trusted:
            return
        name = "".join(c if c.isalnum() or c in "-_." else "_"
                       for c in (app.ApplicationUri or "client"))[:80]
        path = self.rejected_dir / f"{name}-{cert.serial_number:x}.der"
        if not path.exists():
            path.write_bytes(der)
            log.warning("OPC UA: refused the untrusted client certificate of %s; to trust it, move "
                        "%s to %s", app.ApplicationUri, path, self.trusted_dir)
        raise ServiceError(ua.StatusCodes.BadCertificateUntrusted)


def ensure_certificate(folder: Path, app_uri: str, hosts: list[str]) -> tuple[Path, Path]:
    """The server's key and certificate in ``folder``, made (once) if absent."""
    key_path, cert_path = folder / "server-key.pem", folder / "server-cert.der"
    if key_path.exists() and cert_path.exists():
        cert = x509.load_der_x509_certificate(cert_path.read_bytes())
        if cert.not_valid_after_utc < dt.datetime.now(dt.timezone.utc):
            log.error("OPC UA: the server certificate %s expired on %s; delete it and the key to "
                      "make a new one (PLCs must then trust the new one)", cert_path,
                      cert.not_valid_after_utc.date())
        return key_path, cert_path
    folder.mkdir(parents=True, exist_ok=True)
    key = cert_gen.generate_private_key()
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(app_uri)]
    names += [x509.DNSName(h) for h in dict.fromkeys(hosts) if h]
    cert = cert_gen.generate_self_signed_app_certificate(
        key, "visionserve", {"organizationName": "visionserve"}, names,
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], days=CERT_DAYS)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private: owner only
    with os.fdopen(fd, "wb") as f:
        f.write(cert_gen.dump_private_key_as_pem(key))
    cert_path.write_bytes(cert.public_bytes(Encoding.DER))
    log.info("OPC UA: made the server certificate %s (valid %d days, application URI %s); PLCs "
             "that check certificates must trust it", cert_path, CERT_DAYS, app_uri)
    return key_path, cert_path


#: what a channel whose policy is not offered may ask: discovery, never a session
_DISCOVERY = frozenset(ua.NodeId(ua.Int32(i)) for i in (
    ua.ObjectIds.GetEndpointsRequest_Encoding_DefaultBinary,
    ua.ObjectIds.FindServersRequest_Encoding_DefaultBinary))
#: hosts refused a session for their channel's policy: each is logged once
_REFUSED_HOSTS: set[str] = set()


class _Processor(UaProcessor):
    """asyncua's request processor for one connection, refusing every request but discovery on
    a secure channel whose policy and mode were not offered (asyncua itself lets any client
    open a session on a channel with security None)."""

    def set_policies(self, policies) -> None:
        self.offered = policies  # the server's policy factories
        super().set_policies(policies)

    async def _process_message(self, typeid, requesthdr, seqhdr, body):
        policy = self._connection.security_policy
        if typeid not in _DISCOVERY and not any(f.matches(policy.URI, policy.Mode)
                                                for f in getattr(self, "offered", ())):
            host = str(self.name[0]) if self.name else "?"
            if host not in _REFUSED_HOSTS:  # once per host: a client retrying must not flood
                _REFUSED_HOSTS.add(host)
                log.warning("OPC UA: refused a session request from %s on a channel with security "
                            "%s, %s, which is not offered (--opcua-security)", host,
                            policy.URI.rsplit("#", 1)[-1], policy.Mode.name)
            raise ServiceError(ua.StatusCodes.BadSecurityPolicyRejected)
        return await super()._process_message(typeid, requesthdr, seqhdr, body)


class _Connection(OPCUAProtocol):
    """One client connection: its slot (:mod:`.slots`) and the processor that checks its
    channel's policy."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.connected_at = time.monotonic()
        self.heard_at: float | None = None

    def connection_made(self, transport) -> None:
        if len(self.clients) >= self.iserver.max_connections:
            victim = slots.evictee([c for c in self.clients
                                    if isinstance(c, _Connection) and not c.in_session()],
                                   min_idle_s=0)
            if victim is not None:
                log.info("OPC UA: closed a connection from %s without a session to make room "
                         "for a new client (--plc-max-clients)", victim.peer_name)
                self.clients.remove(victim)  # its slot is free now, not when the close is done
                if victim.transport is not None:
                    victim.transport.close()
        super().connection_made(transport)
        if self.processor is not None:  # accepted
            self.processor = _Processor(self.iserver, self.transport, self.limits)
            self.processor.set_policies(self.policies)

    def in_session(self) -> bool:
        session = self.processor.session if self.processor is not None else None
        return session is not None and session.is_activated()

    def data_received(self, data: bytes) -> None:
        self.heard_at = time.monotonic()
        super().data_received(data)


class _Listener(BinaryServer):
    def _make_protocol(self) -> _Connection:
        return _Connection(iserver=self.iserver, policies=self._policies, clients=self.clients,
                           closing_tasks=self.closing_tasks, limits=self.limits)


class _Server(Server):
    """asyncua's server, listening with :class:`_Listener`: ``start`` is asyncua 2.1.0's (the
    version pinned), but for the listener class, which it names inline."""

    async def start(self) -> None:
        if self.iserver.certificate is not None:  # warnings about it (a host name missing...)
            uacrypto.check_certificate(self.iserver.certificate, self._application_uri,
                                       socket.gethostname())
        await self._setup_server_nodes()
        await self.iserver.start()
        try:
            host, port = self._get_bind_socket_info()
            self.bserver = _Listener(self.iserver, host, port, self.limits)  # type: ignore[arg-type]
            self.bserver.set_policies(self._policies)
            await self.bserver.start()
        except Exception:
            await self.iserver.stop()
            raise


def _value(value, vtype) -> ua.DataValue:
    return ua.DataValue(ua.Variant(value, vtype))


def _refusal(exc: VisionServeError) -> ua.StatusCode:
    """A method's refusal as its Bad status (asyncua answers it as the call's status)."""
    code = {"not_found": ua.StatusCodes.BadNotFound,
            "conflict": ua.StatusCodes.BadInvalidState,
            "unavailable": ua.StatusCodes.BadInvalidState,
            }.get(exc.kind, ua.StatusCodes.BadInvalidArgument)
    return ua.StatusCode(ua.UInt32(code))


class OpcUaPublisher:
    protocol = "opcua"

    def __init__(self, endpoint: str, stations: Stations, bus, *, policies: str, anonymous: bool,
                 user: str | None, password_file: Path | None, data_dir: Path,
                 recipes: dict, max_clients: int = 8, idle_timeout_s: float = 30.0,
                 ask=None, trigger=None) -> None:
        self.endpoint = endpoint
        self.stations = stations
        self.bus = bus
        self.policies = parse_policies(policies)
        self.secure = any(p is not ua.SecurityPolicyType.NoSecurity for p in self.policies)
        password = read_password(password_file)
        if user and password is None:
            raise ConfigError("--opcua-user needs --opcua-password-file")
        if not user and not anonymous:
            raise ConfigError("OPC UA: nobody could log in: set --opcua-user and "
                              "--opcua-password-file, or allow --opcua-anonymous")
        self.users = _Users(anonymous, user, password)
        self.data_dir = data_dir / "opcua"
        self.recipes = recipes  # {"recipes": [...], "stations": {station: recipe or None}}
        self.ask = ask  # ask(station, recipe, caller): the serving process switches (awaitable)
        #: trigger(PLC station, part id or None, caller): the serving process takes it (awaitable)
        self.trigger = trigger
        self.max_clients = max_clients
        self.idle_timeout_s = idle_timeout_s
        self.server: Server | None = None
        self._nodes: dict[str, ua.NodeId] = {}
        self._station_nodes: list[dict[str, ua.NodeId]] = []
        self._station_events: list[EventGenerator] = []
        self._system_events: EventGenerator | None = None
        self._last: dict[ua.NodeId, object] = {}
        self._counts = [0] * len(stations)
        self._delay = metrics.BUS_DELAY.labels(self.protocol)
        self._queue: deque[ResultEvent] = deque()
        self._ready = asyncio.Event()
        self._forwarder: asyncio.Task | None = None

    async def start(self) -> None:
        hostname = socket.gethostname()
        app_uri = f"urn:{hostname}:visionserve"
        # asyncua logs its whole standard address space being built at INFO; its warnings about
        # our certificate are worth seeing
        logging.getLogger("asyncua").setLevel(logging.WARNING)
        server = _Server(user_manager=self.users)
        await server.init()
        server.iserver.max_connections = self.max_clients  # more are closed at once (asyncua)
        server.iserver.max_pending_activation_seconds = self.idle_timeout_s
        server.set_endpoint(self.endpoint)
        server.set_server_name("visionserve")
        await server.set_application_uri(app_uri)
        server.product_uri = "urn:visionserve"
        server.manufacturer_name = "visionserve"
        server.set_security_policy(self.policies)
        tokens: list[type] = ([ua.AnonymousIdentityToken] if self.users.anonymous else []) + \
            ([ua.UserNameIdentityToken] if self.users.user else [])
        server.set_identity_tokens(tokens)
        if self.secure:
            host = (self.endpoint.split("//", 1)[-1].rsplit(":", 1)[0]).strip("[]")
            key, cert = ensure_certificate(self.data_dir, app_uri,
                                           [hostname, "localhost"] + ([host] if host else []))
            await server.load_certificate(str(cert))
            await server.load_private_key(str(key))
            trust = _TrustList(self.data_dir)
            if trust.trusted:
                server.set_certificate_validator(trust.validate)
            else:
                log.warning("OPC UA: every client application certificate is accepted (%s is "
                            "empty); put the PLCs' certificates there to accept only those",
                            trust.trusted_dir)
        self.server = server
        await self._build(server)
        # asyncua logs each refused client and odd request at ERROR/WARNING; our own lines say
        # it once per user, and its debug detail is there with --log-level debug
        if not log.isEnabledFor(logging.DEBUG):
            logging.getLogger("asyncua").setLevel(logging.CRITICAL)
        try:
            await server.start()
        except OSError as exc:
            raise OSError(
                f"OPC UA: cannot listen on {self.endpoint}: {exc.strerror or exc}") from exc
        self._forwarder = asyncio.create_task(self._forward())
        log.info("OPC UA listening on %s (security %s; anonymous %s; user %s)", self.endpoint,
                 ", ".join(sorted({p.name.split("_")[0] for p in self.policies})),
                 "allowed" if self.users.anonymous else "refused", self.users.user or "none")

    async def _build(self, server: Server) -> None:
        idx = await server.register_namespace(NAMESPACE)
        etype = await server.create_custom_event_type(
            idx, "ResultReadyEventType", ua.ObjectIds.BaseEventType, list(EVENT_FIELDS))
        system = await server.nodes.objects.add_object(idx, "VisionSystem")
        sm = await system.add_object(idx, "VisionStateMachine")
        auto = await sm.add_object(idx, "AutomaticModeStateMachine")
        status = await system.add_object(idx, "Status")
        recipes = await system.add_object(idx, "RecipeManagement")
        results = await system.add_object(idx, "ResultManagement")

        async def var(parent, name, value, vtype):
            node = await parent.add_variable(idx, name, ua.Variant(value, vtype))
            return node.nodeid

        n = self._nodes
        n["State"] = await var(sm, "CurrentState", ua.LocalizedText("Preoperational"),
                               ua.VariantType.LocalizedText)
        n["StateTime"] = await var(sm, "LastTransitionTime", dt.datetime.now(dt.timezone.utc), _T)
        n["AutoState"] = await var(auto, "CurrentState", ua.LocalizedText(""),
                                   ua.VariantType.LocalizedText)
        for name, value, vtype in (("Ready", False, _B), ("Heartbeat", False, _B),
                                   ("HeartbeatCount", 0, _U), ("Fault", False, _B),
                                   ("FaultReason", "", _S)):
            n[name] = await var(status, name, value, vtype)
        await var(recipes, "Recipes", list(self.recipes["recipes"]), _S)
        stations = self.recipes["stations"]
        n["RecipeStations"] = await var(recipes, "Stations", sorted(stations), _S)
        n["ActiveRecipes"] = await var(recipes, "ActiveRecipes",
                                       [stations[k] or "" for k in sorted(stations)], _S)
        string = ua.NodeId(ua.Int32(ua.ObjectIds.String))

        def arg(name: str) -> ua.Argument:
            return ua.Argument(Name=name, DataType=string, ValueRank=-1)

        if self.ask is not None and stations:
            await recipes.add_method(idx, "ActivateRecipe", self._activate_recipe,
                                     [arg("Station"), arg("Recipe")], [arg("Result")])
        for i, camera in enumerate(self.stations.names):
            station = await results.add_object(idx, f"Station{i + 1}")
            await station.add_property(idx, "CameraId", camera)
            if self.trigger is not None:
                await station.add_method(idx, "Trigger", functools.partial(self._trigger, camera),
                                         [arg("PartId")], [arg("Result")])
            nodes = {"Busy": await var(station, "Busy", False, _B),
                     "ResultCount": await var(station, "ResultCount", 0, _U)}
            last = await station.add_object(idx, "LastResult")
            for name, vtype in RESULT_FIELDS:
                nodes[name] = await var(last, name, _EMPTY[vtype], vtype)
            times = await last.add_object(idx, "ProcessingTimes")
            for name, vtype in TIME_FIELDS:
                nodes[name] = await var(times, name, _EMPTY[vtype], vtype)
            self._station_nodes.append(nodes)
            self._station_events.append(await server.get_event_generator(etype, station.nodeid))
        self._system_events = await server.get_event_generator(etype, system.nodeid)

    async def _activate_recipe(self, parent, station: ua.Variant, recipe: ua.Variant):
        """ActivateRecipe(Station, Recipe) -> Result: the station runs the recipe from its next
        frame (as ``POST /v1/stations/{station}/recipe``; Result: that call's JSON answer). A
        refusal is a Bad status with the server's message: BadNotFound (unknown station or
        recipe), BadInvalidState (the version is not loaded, or another station needs other
        verdict settings), BadInvalidArgument."""
        assert self.ask is not None
        try:
            answer = await self.ask(str(station.Value), str(recipe.Value), {"client": "opcua"})
        except VisionServeError as exc:
            log.info("OPC UA ActivateRecipe(%s, %s) refused: %s", station.Value, recipe.Value,
                     exc.message)
            return _refusal(exc)
        self.recipes_changed({**self.recipes["stations"], answer["station"]: answer["recipe"]})
        return [ua.Variant(json.dumps(answer), _S)]

    async def _trigger(self, name: str, parent, part_id: ua.Variant):
        """Station<N>.Trigger(PartId) -> Result: PLC station ``name`` acquires (its camera, or
        each camera of the recipes file's station of that name) and inspects; returns as soon as
        the trigger is taken (Result: ``{"station", "part_id", "cameras"}`` as JSON); the verdict
        comes as the station's next ResultReady event with that part id. An empty PartId: the
        server names the part. A refusal is a Bad status with the server's message: BadNotFound
        (no camera), BadInvalidState (a camera not triggered by a call, a station without a
        recipe, the serving process unavailable), BadInvalidArgument (a bad part id)."""
        assert self.trigger is not None
        try:
            answer = await self.trigger(name, str(part_id.Value or "") or None,
                                        {"client": "opcua"})
        except VisionServeError as exc:
            log.info("OPC UA Trigger(%r) of station %s refused: %s", part_id.Value, name,
                     exc.message)
            return _refusal(exc)
        return [ua.Variant(json.dumps(answer), _S)]

    def recipes_changed(self, stations: dict) -> None:
        """What each station runs now (switched by any client)."""
        self.recipes = {**self.recipes, "stations": stations}
        if self.server is not None and "ActiveRecipes" in self._nodes:
            order = sorted(stations)
            asyncio.get_running_loop().create_task(self._write_many({
                self._nodes["RecipeStations"]: (order, _S),
                self._nodes["ActiveRecipes"]: ([stations[k] or "" for k in order], _S)}))

    async def _write_many(self, values: dict) -> None:
        assert self.server is not None
        for node, (value, vtype) in values.items():
            await self.server.write_attribute_value(node, _value(value, vtype))

    def accept(self, events: list[ResultEvent]) -> None:
        """Results, as they arrive: published in order by :meth:`_forward`."""
        self._queue.extend(events)
        self._ready.set()

    async def _forward(self) -> None:
        queue = self._queue
        while True:
            await self._ready.wait()
            self._ready.clear()
            while queue:
                events = list(queue)
                queue.clear()
                try:
                    await self.publish(events)
                except Exception:
                    log.exception("OPC UA: could not publish %d results", len(events))

    async def publish(self, events: list[ResultEvent]) -> None:
        server, system_events = self.server, self._system_events
        assert server is not None and system_events is not None, "publish before start"
        for ev in events:
            self._counts[ev.station] += 1
            values = self._values(ev)
            nodes = self._station_nodes[ev.station]
            for name, vtype in RESULT_FIELDS + TIME_FIELDS:
                await server.write_attribute_value(nodes[name], _value(values[name], vtype))
            await server.write_attribute_value(
                nodes["ResultCount"], _value(self._counts[ev.station], _U))
            message = f"{ev.verdict} part {ev.part_id or '-'} ({self.stations.names[ev.station]})"
            values["Station"] = f"Station{ev.station + 1}"
            values["CameraId"] = ev.camera_id or ""
            for gen in (self._station_events[ev.station], system_events):
                e = gen.event
                for name, _ in EVENT_FIELDS:
                    setattr(e, name, values[name])
                e.Severity = _SEVERITY[ev.code]
                await gen.trigger(time_attr=values["EndTime"], message=message)
            self._delay.observe(time.monotonic() - ev.final_mono)

    def _values(self, ev: ResultEvent) -> dict:
        utc = dt.timezone.utc
        return {
            "ResultId": ev.result_id, "Sequence": self._counts[ev.station],
            "PartId": ev.part_id or "",
            "ResultState": RESULT_STATE.get(ev.reason, RESULT_STATE_FAILED),
            "ResultCode": int(ev.code),
            "Reason": int(ev.reason), "ReasonText": ev.message, "Verdict": ev.verdict,
            "Label": ev.label, "LabelIndex": ev.label_index,
            "Score": 0.0 if math.isnan(ev.score) else ev.score, "Model": ev.model,
            "ModelVersion": ev.version, "FrameIndex": ev.index,
            "CreationTime": dt.datetime.fromtimestamp(ev.final_time, utc),
            "StartTime": dt.datetime.fromtimestamp(ev.arrival_time, utc),
            "EndTime": dt.datetime.fromtimestamp(ev.final_time, utc),
            "QueueDuration": ev.queue_ms, "ProcessingDuration": ev.compute_ms,
            "TotalDuration": ev.total_ms,
        }

    async def update(self, line: LineStatus) -> None:
        state = SystemState(line.state)
        changed = await self._set(self._nodes["State"], ua.LocalizedText(STATE_NAMES[state]),
                                  ua.VariantType.LocalizedText)
        if changed:
            await self._set(self._nodes["StateTime"], dt.datetime.now(dt.timezone.utc), _T)
            await self._set(self._nodes["AutoState"], ua.LocalizedText(
                "Ready" if state is SystemState.OPERATIONAL else ""), ua.VariantType.LocalizedText)
        await self._set(self._nodes["Ready"], line.ready, _B)
        await self._set(self._nodes["Heartbeat"], line.heartbeat, _B)
        await self._set(self._nodes["HeartbeatCount"], line.heartbeat_count & 0xFFFFFFFF, _U)
        await self._set(self._nodes["Fault"], bool(line.fault), _B)
        await self._set(self._nodes["FaultReason"], line.reason if line.fault else "", _S)
        for i, nodes in enumerate(self._station_nodes):
            await self._set(nodes["Busy"], self.bus.inflight[i] > 0, _B)

    async def _set(self, node: ua.NodeId, value, vtype) -> bool:
        """Write only changes: each write notifies every subscribed client."""
        if self._last.get(node) == value:
            return False
        self._last[node] = value
        assert self.server is not None, "update before start"
        await self.server.write_attribute_value(node, _value(value, vtype))
        return True

    async def stop(self) -> None:
        if self._forwarder is not None:
            self._forwarder.cancel()
            await asyncio.gather(self._forwarder, return_exceptions=True)
        if self.server is not None:
            await self.server.stop()


_EMPTY = {_S: "", _I: 0, _U: 0, _D: 0.0, _B: False,
          _T: dt.datetime(1601, 1, 1, tzinfo=dt.timezone.utc)}  # OPC UA's "no time"
