/*
 * ppoz.h: a C client for the PPOZ broker (docs/protocol.md, protocol version 1).
 *
 * One ppoz_client owns one ZeroMQ context and one DEALER socket. Each call
 * sends one request ([empty frame, msgpack body]) and blocks until its reply,
 * following the protocol's retry rule (docs/protocol.md, section 5):
 *
 *   - every request gets a fresh rid (random 64-bit hex + a counter), kept
 *     across all attempts of that request, so the broker applies it once;
 *   - an attempt waits at most `attempt_timeout_ms` for the reply; with no
 *     reply the socket is closed (LINGER 0) and a new one sends the same bytes;
 *   - an error reply `overloaded`, `timeout` or `internal` is retried after its
 *     `retry_after_ms` (else 100 ms); any other error is returned at once;
 *   - a reply whose rid is not the request's is a late answer: ignored;
 *   - past `deadline_ms` (the whole request, waits included) the call returns
 *     PPOZ_ERR_TIMEOUT, or the broker's last error if a retry wait would end
 *     past the deadline (so the caller learns it was, say, `overloaded`).
 *
 * Every call returns PPOZ_OK (0) or a negative PPOZ_ERR_*; ppoz_error_code()
 * and ppoz_error_message() describe the last error. A client is not thread
 * safe: give each thread its own.
 */
#ifndef PPOZ_H
#define PPOZ_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PPOZ_PROTOCOL_VERSION 1
#define PPOZ_MAX_RID_BYTES 64     /* the protocol's bound on a rid */
#define PPOZ_MAX_TASK_ID 128      /* the protocol's bound on a task_id */
#define PPOZ_TASK_ID_CAP (PPOZ_MAX_TASK_ID + 1) /* a buffer that holds any task id */
#define PPOZ_DEFAULT_RETRY_AFTER_MS 100 /* the wait before a retry when the reply suggests none */
#define PPOZ_TEXT_CAP 65536       /* bytes of a generate reply's text a ppoz_reply keeps, its NUL included */

/* Return codes: one per protocol error code (docs/protocol.md, section 4), then local ones. */
enum {
    PPOZ_OK = 0,
    PPOZ_ERR_BAD_REQUEST = -1,           /* "bad_request" */
    PPOZ_ERR_UNKNOWN_OP = -2,            /* "unknown_op" */
    PPOZ_ERR_UNKNOWN_TASK = -3,          /* "unknown_task": attach again */
    PPOZ_ERR_FEEDBACK_WITHOUT_STEP = -4, /* "feedback_without_step": nothing recorded */
    PPOZ_ERR_TOO_LARGE = -5,             /* "too_large" */
    PPOZ_ERR_UNSUPPORTED_VERSION = -6,   /* "unsupported_version" */
    PPOZ_ERR_OVERLOADED = -7,            /* "overloaded" (retried until the deadline) */
    PPOZ_ERR_TIMEOUT = -8,               /* "timeout": the broker's, or no reply within deadline_ms */
    PPOZ_ERR_INTERNAL = -9,              /* "internal" (retried until the deadline) */
    PPOZ_ERR_PROTOCOL = -10,             /* "protocol_error": a malformed reply, or an unknown error code */
    PPOZ_ERR_SYSTEM = -11,               /* "system_error": ZeroMQ or memory failure (errno in the message) */
    PPOZ_ERR_INVALID_ARGUMENT = -12      /* "invalid_argument": a bad argument; nothing was sent */
};

/* The name of a return code ("ok", "bad_request", ..., "invalid_argument"); "unknown" for others. */
const char *ppoz_strerror(int rc);

/* --- The client ------------------------------------------------------------------------ */

typedef struct ppoz_client ppoz_client;

/*
 * Connect to the broker's front end (e.g. "tcp://127.0.0.1:5555"). Nothing is
 * sent yet: a broker that is not up is waited for by the first request.
 * `deadline_ms`: the longest time one call may take, retries included;
 * `attempt_timeout_ms`: the longest wait for the reply to one send (make it
 * longer than the slowest model forward you expect). Both must be > 0.
 * Returns NULL with errno set (EINVAL for bad arguments or endpoint, ENOMEM).
 */
ppoz_client *ppoz_open(const char *endpoint, int deadline_ms, int attempt_timeout_ms);

/* Close the socket and the context. NULL is allowed. */
void ppoz_close(ppoz_client *c);

/*
 * Create a session. `task_id` is in/out, a buffer of `cap` bytes, cap >=
 * PPOZ_TASK_ID_CAP: pass "" to let the broker choose the id, or a task id to
 * name your own or resume it (after a client restart); on success it holds the
 * session's task id.
 */
int ppoz_attach(ppoz_client *c, char *task_id, size_t cap);

/* May the client step now? *ready = 1 for status "ok", 0 for "wait" with
 * *retry_after_ms set (0 when ready). Advisory: a step sent anyway is served if it can be. */
int ppoz_ask(ppoz_client *c, const char *task_id, int *ready, int *retry_after_ms);

/*
 * Score an observation: `prompt`, `question` (NULL to leave it out; the broker
 * then uses ""), and `n_actions` >= 1 candidate actions. On success *action is
 * the index of the chosen candidate (0 <= *action < n_actions) and
 * *policy_version the version of the policy that chose it. Either out pointer
 * may be NULL.
 */
int ppoz_step(ppoz_client *c, const char *task_id, const char *prompt, const char *question,
              const char *const *actions, size_t n_actions, int *action, int *policy_version);

/* generate's sampling settings (docs/protocol.md, section 3), sent as the map `sampling`, keys in
 * this order. C has no defaults here: set temperature and top_p (1.0 and 1.0 are the broker's). */
typedef struct ppoz_sampling {
    int max_new_tokens;        /* the response's token budget: >= 1 (at most the broker's max_new_tokens, 4096 by default) */
    double temperature;        /* >= 0 (0 is greedy decoding; the broker allows up to 100) */
    double top_p;              /* in (0, 1] */
    const char *const *stop;   /* n_stop non-empty stop strings; 0: `stop` left out */
    size_t n_stop;
    int has_seed;              /* 1: send `seed`; 0: left out (the broker picks a fresh one) */
    int64_t seed;              /* 0 to 2^63 - 1 */
} ppoz_sampling;

/*
 * Ask the policy to write a response (docs/protocol.md, "generate"). The prompt is exactly one of
 * `prompt` (a string, tokenized as it is) and the chat `messages`: n_messages >= 1 pairs
 * roles[i] ("system", "user", "assistant" or "tool") and contents[i] (pass prompt NULL, or roles,
 * contents NULL and n_messages 0 for the one you leave out). `sampling` must not be NULL.
 * `deadline_ms` > 0 is sent as the request's `deadline_ms` (the broker's limit for writing the
 * response; it caps it at its generate_timeout_ms); 0 leaves it out (the broker's default, 300 s).
 * The call itself is bounded by the client's deadline_ms and attempt_timeout_ms, as every call:
 * make them longer than a response takes.
 *
 * On success `text` (text_cap bytes; may be NULL when text_cap is 0) holds the response,
 * NUL-terminated, cut at a UTF-8 character boundary when it does not fit, and *text_len its
 * whole length in bytes as the broker sent it: the text was cut when *text_len >= text_cap (a
 * buffer of PPOZ_TEXT_CAP bytes holds any text the client keeps; a longer one is cut there too,
 * and ppoz_last_reply(c)->text_truncated is then 1). *n_tokens is the response's token count,
 * *finish_reason "eos", "stop" or "length" (a static string), *policy_version the version of the
 * policy that wrote it; its summed log-probability is ppoz_last_reply(c)->logprob. Any out pointer
 * may be NULL. Its reward goes in with ppoz_feedback, as a step's. Retried as a step is.
 */
int ppoz_generate(ppoz_client *c, const char *task_id, const char *prompt, const char *const *roles,
                  const char *const *contents, size_t n_messages, const ppoz_sampling *sampling, int deadline_ms,
                  char *text, size_t text_cap, size_t *text_len, int *n_tokens, const char **finish_reason,
                  int *policy_version);

/* The reward of the pending step (finite); `done` ends the episode, `truncated` cuts it. */
int ppoz_feedback(ppoz_client *c, const char *task_id, double reward, int done, int truncated);

/* Close the task's open segment and forget the session. */
int ppoz_detach(ppoz_client *c, const char *task_id);

/* Liveness check; *time_ms (may be NULL) is the broker's clock. */
int ppoz_ping(ppoz_client *c, int64_t *time_ms);

/* The last error's code ("ok" after a success, else e.g. "unknown_task",
 * "timeout", "invalid_argument") and its message (the broker's, or ours). */
const char *ppoz_error_code(const ppoz_client *c);
const char *ppoz_error_message(const ppoz_client *c);

/* Sends so far, retries included (for tests and diagnostics). */
unsigned long ppoz_attempts(const ppoz_client *c);

/* The last reply received for a request of this client (all its parsed fields:
 * logprob, resumed, reason, segment_closed, ...), or NULL before any. It stays
 * valid until the next call on `c`. */
struct ppoz_reply;
const struct ppoz_reply *ppoz_last_reply(const ppoz_client *c);

/* --- Low level: encoding requests and parsing replies ---------------------------------- */

typedef enum ppoz_op {
    PPOZ_OP_ATTACH,
    PPOZ_OP_DETACH,
    PPOZ_OP_ASK,
    PPOZ_OP_STEP,
    PPOZ_OP_RAG_STEP,
    PPOZ_OP_GENERATE,
    PPOZ_OP_FEEDBACK,
    PPOZ_OP_STATUS,
    PPOZ_OP_PING
} ppoz_op;

/* The protocol name of an op ("attach", ...); NULL for an unknown value. */
const char *ppoz_op_name(ppoz_op op);

/* One request. Fields not used by `op` are ignored. */
typedef struct ppoz_request {
    ppoz_op op;
    const char *rid;                /* 1 to 64 bytes, unique per request */
    const char *task_id;            /* NULL: left out (allowed for attach only) */
    /* step / rag_step: the observation */
    const char *prompt;             /* also generate's `prompt` (NULL: send `messages` instead) */
    const char *question;           /* NULL: left out */
    const char *const *actions;
    size_t n_actions;
    int deadline_ms;                /* step, rag_step, generate: > 0: sent as `deadline_ms`; 0: left out (the broker's default) */
    /* generate: exactly one of `prompt` (above) and `messages`, n_messages pairs {role, content} */
    const char *const *roles;
    const char *const *contents;
    size_t n_messages;
    ppoz_sampling sampling;
    /* feedback */
    double reward;
    int done;
    int truncated;
} ppoz_request;

/*
 * Encode a request body as the Python side does: a msgpack map with the keys
 * proto, v, op, rid, then the op's fields in the documented order (task_id;
 * obs {prompt, question, action}, deadline_ms; prompt or messages [{role,
 * content}], sampling {max_new_tokens, temperature, top_p, stop, seed},
 * deadline_ms; reward, done, truncated), floats as float64, booleans as msgpack
 * bools. On success *out is a malloc'd buffer of *out_len bytes (release it
 * with free()). Returns PPOZ_OK,
 * PPOZ_ERR_INVALID_ARGUMENT (with a reason in `why`, which may be NULL) or
 * PPOZ_ERR_SYSTEM.
 */
int ppoz_encode_request(const ppoz_request *req, char **out, size_t *out_len, char *why, size_t why_cap);

/* The fields of a reply a client uses. Strings are NUL-terminated (the error
 * message, reason, status and text are cut to fit); has_* say whether a field was present.
 * It holds a generate's text (PPOZ_TEXT_CAP bytes), so it is about 66 KiB: mind the stack. */
typedef struct ppoz_reply {
    char op[16];
    char rid[PPOZ_MAX_RID_BYTES + 1]; /* str or bin; compare with rid_len */
    size_t rid_len;
    int has_rid;                      /* 0 when missing or nil */
    char status[16];
    char task_id[PPOZ_TASK_ID_CAP];
    int has_task_id;
    int is_error;                     /* the reply carries `error` */
    char error_code[32];
    char error_message[512];
    int has_retry_after_ms;
    int64_t retry_after_ms;
    char reason[32];
    int has_action;
    int64_t action;
    int has_logprob;
    double logprob;
    size_t n_probs;
    int has_policy_version;
    int64_t policy_version;
    int resumed;
    int segment_closed;
    int64_t segments_closed;
    int dropped_pending_step;
    int has_time_ms;
    int64_t time_ms;
    /* generate (its logprob and policy_version are above) */
    int has_text;
    char text[PPOZ_TEXT_CAP];         /* the response, NUL-terminated; cut at a UTF-8 character boundary when longer */
    size_t text_len;                  /* bytes held in `text`, its NUL excluded (the response may hold a NUL) */
    size_t text_full_len;             /* bytes of the response as sent: > text_len when it was cut */
    int text_truncated;               /* 1 when `text` holds only the first text_len of text_full_len bytes */
    int has_n_tokens;
    int64_t n_tokens;
    char finish_reason[16];           /* "eos", "stop", "length"; "" when absent */
} ppoz_reply;

/*
 * Parse one reply body (the last frame). Unknown fields are ignored.
 * Returns PPOZ_OK or PPOZ_ERR_PROTOCOL (not one msgpack map, a known field of
 * the wrong type, a task_id or rid over its bound), with the reason in `why`
 * (may be NULL).
 */
int ppoz_parse_reply(const void *data, size_t len, ppoz_reply *out, char *why, size_t why_cap);

/* The return code of a protocol error code ("unknown_task" -> PPOZ_ERR_UNKNOWN_TASK);
 * PPOZ_ERR_PROTOCOL for a code not in the protocol's closed list. */
int ppoz_code_to_rc(const char *code);

#ifdef __cplusplus
}
#endif

#endif /* PPOZ_H */
