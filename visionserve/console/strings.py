"""Every text the console shows, in English, in one place: the templates read :data:`STRINGS`
(as ``s``), the script reads the part of it :data:`SCRIPT_KEYS` names (a JSON block on each
page). ``{name}`` fields are filled where the text is used."""

from __future__ import annotations

STRINGS: dict[str, str] = {
    # the frame of every page
    "product": "visionserve",
    "console": "Operator console",
    "nav_label": "Pages",
    "nav_live": "Line live",
    "nav_parts": "NG parts",
    "nav_models": "Models",
    "nav_stations": "Stations and recipes",
    "nav_system": "System",
    "nav_review": "Review",
    "nav_audit": "Audit log",
    "skip_to_content": "Skip to content",
    "signed_in_as": "Signed in as {user} ({role})",
    "sign_out": "Sign out",
    "times_in": "Times in {zone}.",
    "rendered_at": "Shown at {time}.",
    "reload": "Reload",
    "none": "none",
    "yes": "yes",
    "no": "no",
    "unknown": "unknown",
    "error_reading": "Could not read this: {error}",
    # the confirmation dialog and the messages of actions (the script shows these)
    "confirm_title": "Please confirm",
    "confirm_ok": "Yes, do it",
    "confirm_cancel": "Cancel",
    "working": "Working…",
    "done": "Done: {what}.",
    "refused": "The server refused: {error} (HTTP {status})",
    "network_error": "The server could not be reached: {error}",
    # Models
    "models_title": "Models",
    "models_intro": "Each model of the repository, its versions and their state, how it runs, "
                    "and the verdict rules in force.",
    "control_mode": "Model control mode: {mode}.",
    "control_mode_none": "Loading and unloading are turned off on this server "
                         "(--model-control-mode none); the server says why when asked.",
    "no_models": "The repository holds no model.",
    "model_task": "Task",
    "model_backend": "Backend",
    "model_versions": "Versions",
    "col_version": "Version",
    "col_state": "State",
    "col_reason": "Reason",
    "col_device": "Runs on",
    "col_instances": "Instances",
    "batching": "Batching",
    "batch_max": "Largest batch",
    "batch_preferred": "Warmed-up batch sizes",
    "batch_delay": "Longest wait for a batch (ms)",
    "batch_queue": "Queue limit (frames)",
    "batch_takt": "Takt (ms)",
    "verdict_rules": "Verdict rules in force",
    "verdict_empty": "This model's task has no verdict rules.",
    "col_rule": "Rule",
    "col_value": "Value",
    "load": "Load {model}",
    "unload": "Unload {model}",
    "confirm_load": "Load model {model} from the repository? Its versions are swapped in as one "
                    "change; frames keep flowing.",
    "confirm_unload": "Unload every version of model {model}? Frames sent to it are refused "
                      "until it is loaded again.",
    "loaded": "model {model} loaded",
    # Models: changing a model's verdict rules (the form, and what its script shows)
    "verdict_edit": "Change the verdict rules of {model}",
    "verdict_edit_intro": "Preview a change first: it shows which of the model's last answered "
                          "frames would get another verdict. Save is possible once the values "
                          "shown were previewed; the change is audited under your name.",
    "verdict_read_only": "Your role may read these rules but not change them (role quality "
                         "or admin changes them).",
    "verdict_optional": "optional: leave empty for the default",
    "verdict_json": "JSON",
    "verdict_limits": "from {low} to {high}",
    "verdict_at_least": "at least {low}",
    "verdict_at_most": "at most {high}",
    "verdict_preview": "Preview",
    "verdict_save": "Save",
    "verdict_no_change": "No value differs from the rules in force: change one, then preview.",
    "verdict_bad_json": "{field}: not valid JSON ({error}).",
    "verdict_previewed": "{changed} of the last {frames} frames would change verdict.",
    "verdict_unavailable": "{count} frames could not be judged again: {why}",
    "verdict_save_hint": "Save is enabled after a preview of the values shown.",
    "verdict_saved": "Saved: the rules of {model} now in force are {rules}.",
    "col_part": "Part",
    "col_request": "Request",
    "col_change": "Verdict: old → new",
    "col_time": "Time",
    "verdict_changes_caption": "Frames whose verdict would change, newest first",
    "unloaded": "model {model} unloaded",
    # NG parts: the gallery of captured NG frames, and a part's page
    "parts_title": "NG parts",
    "parts_intro": "The captured frames of NG answers, newest first, with the model's answer "
                   "drawn on them. A part id leads to every answer for that part.",
    "parts_filter": "Show NG frames",
    "parts_since": "From ({zone})",
    "parts_until": "Until, not including ({zone})",
    "parts_model": "Model",
    "parts_all_models": "every model",
    "parts_label": "Label",
    "parts_part_id": "Part id",
    "parts_apply": "Show these frames",
    "parts_clear": "Show all NG frames",
    "parts_none": "No captured NG frame matches. Frames are captured with --records and "
                  "--capture ng (or all).",
    "parts_older": "Older NG frames",
    "parts_newest": "Newest NG frames",
    "parts_gallery": "Captured NG frames, newest first",
    "parts_image_alt": "Frame of part {part} from {model} at {time}: {verdict}, the answer "
                       "drawn on it",
    "parts_no_part": "no part id",
    "parts_open_image": "Full size",
    "records_off": "This server keeps no records (--records): there are no NG frames to show.",
    "part_title": "Part {part}",
    "part_intro": "Every answer the server recorded for this part id, newest first, with the "
                  "captured images. A quality user flags an answer whose verdict was wrong.",
    "part_unknown": "No record of part {part} (records are kept for records_max_age_days; is "
                    "X-Part-Id sent?).",
    "part_most": "The newest {count} answers are shown.",
    "part_back": "Back to the NG parts",
    "part_answer": "{time}: {model} version {version}",
    "part_verdict": "Verdict",
    "part_label": "Label",
    "part_score": "Score",
    "part_reasons": "Reasons",
    "part_recipe": "Recipe",
    "part_camera": "Camera",
    "part_camera_time": "Camera time",
    "part_camera_frame": "Camera frame id",
    "part_camera_time_value": "{t:.6f} s (the camera's clock)",
    "part_request": "Request id",
    "part_frame": "Frame in the request",
    "part_timings": "Timings",
    "part_timings_value": "queue {queue_ms} ms, compute {compute_ms} ms, total {total_ms} ms, "
                          "batch of {batch_size}",
    "part_latency_value": "total {total_ms} ms",
    "part_image": "Captured image",
    "part_no_image": "Not captured (the capture policy did not keep this frame).",
    "part_raw_image": "The image as stored",
    "part_image_alt": "Frame of part {part} from {model} at {time}: {verdict}, the answer "
                      "drawn on it",
    # Stations and recipes
    "stations_title": "Stations and recipes",
    "stations_intro": "Which recipe each station runs, and switching it: the switch goes "
                      "through the server's audited recipe route.",
    "no_stations": "No stations: the server has no recipes file (docs/recipes.md).",
    "col_station": "Station",
    "col_recipe": "Recipe",
    "col_model": "Model",
    "col_cameras": "Cameras",
    "col_switch": "Switch to",
    "no_recipe": "no recipe yet",
    "default_version": "default",
    "switch": "Switch {station}",
    "switch_to_label": "Recipe for station {station}",
    "confirm_switch": "Make station {station} run recipe {recipe}? Its next frames are decided "
                      "by that recipe's model and rules.",
    "switched": "station {station} runs recipe {recipe}",
    "recipes_heading": "Recipes",
    "col_description": "Description",
    "col_verdict": "Verdict settings",
    # System
    "system_title": "System",
    "system_intro": "The device and its memory, the processes of the server, the guard's "
                    "training jobs and the PLC link.",
    "server_heading": "Server",
    "ready": "Ready",
    "versions_served": "Model versions loaded",
    "device_heading": "Device",
    "device": "Device",
    "device_cpu": "CPU (no GPU)",
    "device_gpu": "GPU",
    "gpu_budget": "Memory budget",
    "gpu_reserved": "Reserved by the server",
    "gpu_used": "Used by the server",
    "gpu_card_used": "Used on the card (every process)",
    "gpu_card_total": "Card memory",
    "processes_heading": "Processes",
    "frontends": "Front-end processes",
    "frontends_none": "none: HTTP and gRPC run in the serving process",
    "alive_of": "{alive} of {total} alive",
    "batch_workers": "Batch worker processes alive",
    "batch_workers_none": "none: batches run in the serving process",
    "guard_heading": "Training-queue guard",
    "guard_off": "The guard is off on this server (--guard).",
    "guard_no_jobs": "No job is queued, running or paused.",
    "col_job": "Job",
    "col_name": "Name",
    "col_priority": "Priority",
    "col_gpu_mem": "GPU memory",
    "col_submitted": "Submitted",
    "col_started": "Started",
    "plc_heading": "PLC link",
    "plc_off": "No PLC server runs on this server (--opcua, --modbus).",
    "col_protocol": "Protocol",
    "col_clients": "Clients connected",
    "plc_engine_stalled": "Engine stalled (heartbeat stopped)",
    "plc_results": "Results sent to the PLC",
    "col_result": "Result",
    "col_count": "Count",
    "plc_no_results": "No result sent yet.",
    "plc_handshakes": "Last handshake per station (the PLC acknowledged a result)",
    "plc_no_handshakes": "No PLC has acknowledged a result yet (Modbus Result Ack).",
    "col_last_ack": "Last acknowledged",
    # Line live
    "live_title": "Line live",
    "live_intro": "Each answer as it happens, newest on top, and the answers and latency of "
                  "the last minutes against the takt.",
    "live_filter": "Show",
    "live_filter_model": "Model",
    "live_filter_station": "Station",
    "live_all_models": "every model",
    "live_all_stations": "every station",
    "live_apply": "Show these answers",
    "live_answers": "Last answers",
    "live_last_ng": "Last NG part",
    "live_last_ng_none": "No captured NG frame yet.",
    "live_last_ng_caption": "Part {part} · {model} {version} · {time} · {label}",
    "live_last_ng_alt": "The captured frame of NG part {part} with the model's answer drawn on it",
    "live_rows_note": "The newest {rows} answers; older ones leave the list.",
    "live_no_answers": "No answer yet: answers show here as the line sends frames.",
    "col_part_id": "Part id",
    "col_verdict_short": "Verdict",
    "col_label": "Label or reasons",
    "col_latency": "Latency (ms)",
    "live_minutes": "Last {minutes} minutes",
    "live_counts": "Answers per minute",
    "live_latency": "Latency per minute (ms) against the takt",
    "live_ok": "OK",
    "live_ng": "NG",
    "live_late": "LATE",
    "live_refused": "refused",
    "live_p50": "p50",
    "live_p99": "p99",
    "live_takt": "takt",
    "live_totals": "Totals: OK {ok}, NG {ng}, LATE {late}, refused {refused}.",
    "live_latency_now": "This minute: p50 {p50} ms, p99 {p99} ms; takt {takt} ms.",
    "live_no_latency": "none",
    "live_counts_chart": "Answers of {model} per minute over the last {minutes} minutes: "
                         "OK {ok}, NG {ng}, LATE {late}, refused {refused} in all.",
    "live_latency_chart": "Latency of {model} per minute over the last {minutes} minutes "
                          "against its takt of {takt} ms; this minute p50 {p50} ms, "
                          "p99 {p99} ms.",
    "live_since": "Answers kept since {time}.",
    "live_not_kept": "The server keeps answers from when a console first listens.",
    "live_connecting": "Connecting to the server's live results…",
    "live_connected": "Live: answers show as they happen.",
    "live_reconnecting": "The connection to the server was lost; reconnecting…",
    "live_dropped": "{dropped} answers were not shown: this page read slower than the line "
                    "answered ({total} in all).",
    "live_shutdown": "The server is shutting down; this page reconnects when it is back.",
    "live_summary_error": "The counts could not be read: {error}",
    # Audit log
    "audit_title": "Audit log",
    "audit_intro": "Who changed what, and when: verdict rules, recipes, models, the guard's "
                   "jobs, users, and every sign-in, newest first.",
    "audit_filter": "Show",
    "audit_user": "User",
    "audit_user_hint": "a user name, admin-token or loopback",
    "audit_action": "Action",
    "audit_any_action": "every action",
    "audit_since": "From",
    "audit_until": "Until",
    "audit_apply": "Show these entries",
    "audit_clear": "Every entry",
    "audit_empty": "No entry matches.",
    "audit_caption": "Audit entries, newest first; times in {zone}",
    "audit_paging": "Pages of the audit log",
    "audit_older": "Older entries",
    "audit_newer": "Newer entries",
    "audit_newest": "Newest entries",
    "audit_col_time": "Time ({zone})",
    "audit_col_user": "User",
    "audit_col_from": "From",
    "audit_col_action": "Action",
    "audit_col_target": "Target",
    "audit_col_change": "Old → new",
    "audit_declared": "says: {name}",
    "audit_no_user": "nobody signed in",
    "audit_nothing": "—",
    "audit_action_verdict": "Verdict rules changed",
    "audit_action_recipe": "Recipe switched",
    "audit_action_model-load": "Model loaded",
    "audit_action_model-unload": "Model unloaded",
    "audit_action_job-submit": "Guard job submitted",
    "audit_action_job-cancel": "Guard job cancelled",
    "audit_action_user-add": "User added",
    "audit_action_user-remove": "User removed",
    "audit_action_user-role": "Role changed",
    "audit_action_user-password": "Password changed",
    "audit_action_sign-in": "Signed in",
    "audit_action_sign-out": "Signed out",
    "audit_action_sign-in-failed": "Failed sign-in",
    "audit_action_flag": "Frame flagged",
    "audit_action_label": "Frame labelled",
    "audit_action_candidate": "Candidate training requested",
    "audit_action_candidate-evaluate": "Candidate comparison requested",
    "audit_action_promote-approval": "Promotion approved, waiting for a second approver",
    "audit_action_promote": "Candidate promoted",
    "audit_action_rollback": "Promotion rolled back",
    "audit_action_candidate-shadow": "Candidate shadow started",
    "audit_action_candidate-shadow-stop": "Candidate shadow stopped",
    "review_title": "Review and label",
    "review_intro": "Frames captured for learning (--capture learn: NG, uncertain, a sample of "
                    "OK) and frames operators flagged. Say what each shows: the labels are kept "
                    "with the records, by your name, for the model's next training.",
    "review_filter": "Which frames",
    "review_model": "Model",
    "review_state": "Show",
    "review_state_unlabelled": "Not labelled yet",
    "review_state_labelled": "Labelled",
    "review_apply": "Show",
    "review_queue": "Frames",
    "review_none": "No frames here. Frames are captured for learning with --capture learn.",
    "review_no_models": "No model in the repository can be labelled yet (classification, "
                        "anomaly and detection models can).",
    "review_not_labelled_model": "No model {model!r} whose frames can be labelled.",
    "review_kept_for": "Kept as",
    "review_verdict": "Verdict",
    "review_current": "Label",
    "review_unlabelled": "not labelled",
    "review_by": "{label}, by {user} ({source}) at {time}",
    "review_label_for": "Label of record {id}",
    "review_good": "good",
    "review_defective": "defective",
    "review_save": "Save label",
    "review_boxes": "Boxes",
    "review_no_boxes_yet": "none",
    "review_box_label": "Box label",
    "review_add_box": "Add box",
    "review_nothing": "Nothing to find",
    "review_box_hint": "In the frame's pixels, from its top left corner: x1 < x2, y1 < y2.",
    "review_image_alt": "Frame of part {part} from {model} at {time}: {verdict}, kept as "
                        "{kept}, the model's answer drawn on it",
    "review_older": "Older frames",
    "review_newest": "Newest frames",
    "review_saved": "Record {id} labelled: {label}",
    "review_boxes_label": "{n} boxes",
    "part_flag_ok": "This OK was wrong",
    "part_flag_ng": "This NG was wrong",
    "part_flag_for": "What record {id} really shows",
    "part_flag_choose": "What it shows…",
    "part_flag_save": "Flag",
    "part_flagged": "Record {id} flagged: {label}. Its frame is kept for learning.",
    "candidates_title": "Candidates of {model}",
    "candidates_intro": "Models trained on the labelled frames, beside the version in force, "
                        "and how each did on the held-out labelled frames. Promoting one serves "
                        "it as the model's next version without a failed frame; rolling back "
                        "serves the version before it again. Both are kept in the audit log "
                        "under your name.",
    "candidates_link": "Candidates",
    "candidates_serving": "Version in force: {version}.",
    "candidates_caption": "Each candidate on the held-out labelled frames: the live version it "
                          "was compared with → the candidate.",
    "candidates_none": "No candidate yet: train one with POST "
                       "/v1/models/{model}/candidates once frames are labelled.",
    "candidates_in_force": "Version {version} is candidate {candidate}, promoted by {user} at "
                           "{time} (from version {from_version}).",
    "candidates_no_promotion": "No promotion in force.",
    "col_candidate": "Candidate",
    "col_from_version": "From version",
    "col_compared": "Compared with",
    "col_live": "Live version",
    "col_accuracy": "Accuracy",
    "col_ng_recall": "NG recall",
    "col_false_rejects": "False rejects",
    "col_box_recall": "Boxes found",
    "col_disagree": "Disagree",
    "col_shadow": "Shadow on live frames",
    "shadow_summary": "{state}: {judged} frames beside version {version}, agreement {agreement}; "
                      "NG {live_ng} → {candidate_ng}; {dropped} dropped under load",
    "shadow_details": "disagreements",
    "shadow_none": "not run",
    "col_actions": "Actions",
    "candidates_not_compared": "not compared yet",
    "candidates_live_vs": "{live} → {candidate}",
    "promote": "Promote {candidate}",
    "confirm_promote": "Promote candidate {candidate} of model {model}? It is copied into the "
                       "repository as the next version and swapped in for version {version}; "
                       "your approval is kept in the audit log.",
    "promoted": "candidate {candidate} promoted",
    "approved_waiting": "your approval of candidate {candidate} is kept: another user's "
                        "promotes it",
    "candidates_approvers": "A promotion of this model takes two approvers: the first approval "
                            "waits, another user's promotes.",
    "candidates_approved_by": "approved by {users}; waiting for another approver",
    "rollback": "Roll back to version {version}",
    "confirm_rollback": "Roll model {model} back from version {promoted} (candidate "
                        "{candidate}) to version {version}? It is swapped back in; the audit "
                        "log keeps your name.",
    "rolled_back": "model {model} rolled back to version {version}",
}

#: the texts the script needs (the confirmation dialog and the messages of actions)
SCRIPT_KEYS = ("confirm_title", "confirm_ok", "confirm_cancel", "working", "done", "refused",
               "network_error")


#: the texts the verdict form's script needs (``static/verdict.js``)
VERDICT_SCRIPT_KEYS = ("working", "refused", "network_error", "verdict_no_change",
                       "verdict_bad_json", "verdict_previewed", "verdict_unavailable",
                       "verdict_saved", "col_part", "col_request", "col_change", "col_time",
                       "verdict_changes_caption", "none")

#: the texts the Line live page's script needs (its rows, plots and connection state)
LIVE_SCRIPT_KEYS = ("none", "live_ok", "live_ng", "live_late", "live_refused", "live_p50",
                    "live_p99", "live_takt", "live_totals", "live_latency_now", "live_no_latency",
                    "live_counts_chart", "live_latency_chart", "live_since", "live_not_kept",
                    "live_connected", "live_reconnecting", "live_dropped",
                    "live_shutdown", "live_summary_error", "live_last_ng_caption",
                    "live_last_ng_alt")


def script_strings() -> dict[str, str]:
    return {k: STRINGS[k] for k in SCRIPT_KEYS}


def verdict_script_strings() -> dict[str, str]:
    return {k: STRINGS[k] for k in VERDICT_SCRIPT_KEYS}


REVIEW_SCRIPT_KEYS = ("working", "refused", "network_error", "review_saved",
                      "review_boxes_label", "review_no_boxes_yet", "part_flagged")


def review_script_strings() -> dict[str, str]:
    return {k: STRINGS[k] for k in REVIEW_SCRIPT_KEYS}


def live_strings() -> dict[str, str]:
    return {k: STRINGS[k] for k in LIVE_SCRIPT_KEYS}
