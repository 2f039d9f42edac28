"""Manage the people who sign in to the console (docs/security.md, "Users and the console's
sign-in").

  visionserve users add anna --role quality            (asks for the password twice)
  visionserve users add line-pc --role viewer --password-file /run/secrets/line-pc
  printf '%s\\n' "$PASSWORD" | visionserve users passwd anna --password-file -
  visionserve users list | role anna admin | remove anna

Roles, each including the ones before it: viewer (sees everything the console shows), quality
(changes verdict rules and station recipes), admin (loads and unloads models, runs the guard's
jobs, reads the API pages). A password is never taken from the command line, where other users
can read it in the process list: the command asks for it, or reads --password-file (- for standard
input: the first line, without its line break). At least 8 characters.

The users file is --db, else $VISIONSERVE_USERS_DB, else $XDG_DATA_HOME/visionserve/users.sqlite
(~/.local/share/visionserve/users.sqlite; mode 0600): run the command as the server's user, with
the same environment, so that both use the same file. Changes take effect at once, also on a
running server: a removed user's sessions end, a new password ends the user's sessions, a new role
applies to the next request. Every change is audited under the name of the OS user who runs the
command, in the audit file beside the users file ($VISIONSERVE_AUDIT_DB where set). Exit codes: 0
done, 1 no such user or the name is taken, 2 bad input.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from datetime import datetime, timezone
from pathlib import Path

from ..audit import AuditTrail, Entry, audit_db_path, command_caller
from ..config import users_db_path
from .store import (
    DB_ENV,
    DEFAULT_DB,
    ROLES,
    UserConflict,
    UserError,
    UserStore,
    check_password,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", type=Path, default=None,
                        help=f"the users file (default: ${DB_ENV}, else {DEFAULT_DB})")
    password = argparse.ArgumentParser(add_help=False)
    password.add_argument("--password-file", metavar="FILE",
                          help="read the password from FILE's first line (- : standard input) "
                               "instead of asking")
    sub = parser.add_subparsers(dest="users_command", metavar="SUBCOMMAND")
    # no abbreviations: "--password SECRET" must be refused, not read as --password-file
    parser.allow_abbrev = False
    p = sub.add_parser("add", allow_abbrev=False, parents=[common, password],
                       help="add a user with a role")
    p.add_argument("name", help="the sign-in name (letters, digits, . _ @ -; up to 64)")
    p.add_argument("--role", required=True, choices=ROLES, help="what the user may do")
    sub.add_parser("list", allow_abbrev=False, parents=[common],
                   help="list the users and their roles")
    p = sub.add_parser("remove", allow_abbrev=False, parents=[common],
                       help="remove a user; their sessions end")
    p.add_argument("name")
    p = sub.add_parser("passwd", allow_abbrev=False, parents=[common, password],
                       help="set a user's password; their sessions end")
    p.add_argument("name")
    p = sub.add_parser("role", allow_abbrev=False, parents=[common], help="change a user's role")
    p.add_argument("name")
    p.add_argument("role", choices=ROLES)


def _password(args: argparse.Namespace) -> str:
    if args.password_file == "-":
        return check_password(sys.stdin.readline().rstrip("\r\n"))
    if args.password_file:
        try:
            with open(args.password_file, encoding="utf-8") as f:
                return check_password(f.readline().rstrip("\r\n"))
        except OSError as exc:
            raise UserError(f"--password-file {args.password_file}: "
                            f"{exc.strerror or exc}") from None
    if not sys.stdin.isatty():
        raise UserError("no terminal to ask for the password: give --password-file FILE "
                        "(- for standard input)")
    first = check_password(getpass.getpass(f"password for {args.name}: "))
    if getpass.getpass("again: ") != first:
        raise UserError("the two passwords differ; nothing changed")
    return first


def run(args: argparse.Namespace) -> int:
    command = args.users_command
    if command is None:
        print("visionserve users: give a subcommand: add, list, remove, passwd, role "
              "(visionserve users --help)", file=sys.stderr)
        return 2
    path = users_db_path(args.db)
    try:
        if command == "list":
            return _list(path)
        store = UserStore(path, create=command == "add")
        old = new = None
        if command == "add":
            store.add(args.name, args.role, _password(args))
            new = args.role
            print(f"added {args.name} ({args.role}) to {path}")
        elif command == "remove":
            old = _role(store, args.name)
            store.remove(args.name)
            print(f"removed {args.name}; their sessions ended")
        elif command == "passwd":
            store.set_password(args.name, _password(args))
            print(f"new password for {args.name}; their sessions ended")
        else:
            old, new = _role(store, args.name), args.role
            store.set_role(args.name, args.role)
            print(f"{args.name} is now {args.role}")
        _audit(Entry(f"user-{command.replace('passwd', 'password')}", "user", args.name,
                     old and {"role": old}, new and {"role": new},
                     command_caller("visionserve users")), path)
    except FileNotFoundError:
        print(f"visionserve users: no users file at {path} ('users add' makes it)",
              file=sys.stderr)
        return 1
    except UserConflict as exc:
        print(f"visionserve users: {exc}", file=sys.stderr)
        return 1
    except UserError as exc:
        print(f"visionserve users: {exc}", file=sys.stderr)
        return 2
    return 0


def _role(store: UserStore, name: str) -> str | None:
    return next((u.role for u in store.users() if u.name == name), None)


def _audit(entry: Entry, users_file: Path) -> None:
    """Keep the change in the audit file beside the users file (and log its line); a file that
    cannot be written is said on stderr, the change stands."""
    trail = AuditTrail(audit_db_path(None, users_file))
    if not trail.record(entry, "user %s: %s by %s", entry.name, entry.action, entry.by()):
        print(f"visionserve users: warning: the change is not in the audit file {trail.path}",
              file=sys.stderr)


def _list(path: Path) -> int:
    users = UserStore(path).users() if path.is_file() else []
    if not users:
        print(f"no users in {path}: the console follows the API's access rule "
              "(docs/security.md)")
        return 0
    width = max(len(u.name) for u in users)
    print(f"{'NAME':<{width}}  {'ROLE':<7}  CREATED (UTC)")
    for u in users:
        created = datetime.fromtimestamp(u.created, timezone.utc).strftime("%Y-%m-%d %H:%M")
        print(f"{u.name:<{width}}  {u.role:<7}  {created}")
    return 0
