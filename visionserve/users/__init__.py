"""The console's users: names with a role and an argon2 password hash, their sign-in sessions and
the failed-login counters, in one SQLite file of the server's data directory (:mod:`.store`), and
the ``visionserve users`` command that manages them (:mod:`.cli`). The HTTP side (the sign-in
routes, the session check of protected routes) is in :mod:`visionserve.http.signin` and
:mod:`visionserve.security`."""
