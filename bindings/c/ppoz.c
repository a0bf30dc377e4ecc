/*
 * ppoz.c: the PPOZ C client (see ppoz.h and docs/protocol.md).
 *
 * Three layers, top to bottom: the operations (ppoz_attach ... ppoz_ping),
 * which check their arguments and the reply's fields; request(), which runs
 * the retry rule of docs/protocol.md section 5 around one encoded request;
 * and the codec (ppoz_encode_request, ppoz_parse_reply), which touches no socket.
 */
#define _POSIX_C_SOURCE 200809L

#include "ppoz.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <msgpack.h>
#include <zmq.h>

#define PROTOCOL_ID "ppoz"

struct ppoz_client {
    void *ctx;
    void *sock;               /* NULL between a lost attempt and the next send */
    char *endpoint;
    int deadline_ms;
    int attempt_timeout_ms;
    uint64_t rid_prefix;      /* random per client, so rids are unique across clients and restarts */
    uint64_t rid_counter;
    unsigned long attempts;
    int has_reply;
    ppoz_reply reply;         /* the last reply whose rid matched */
    ppoz_reply scratch;       /* the reply being read (here, not on the stack: it holds a text of PPOZ_TEXT_CAP bytes) */
    char code[32];
    char message[512];
};

/* --- Names ------------------------------------------------------------------------------ */

static const struct {
    int rc;
    const char *name;
} CODES[] = {
    {PPOZ_OK, "ok"},
    {PPOZ_ERR_BAD_REQUEST, "bad_request"},
    {PPOZ_ERR_UNKNOWN_OP, "unknown_op"},
    {PPOZ_ERR_UNKNOWN_TASK, "unknown_task"},
    {PPOZ_ERR_FEEDBACK_WITHOUT_STEP, "feedback_without_step"},
    {PPOZ_ERR_TOO_LARGE, "too_large"},
    {PPOZ_ERR_UNSUPPORTED_VERSION, "unsupported_version"},
    {PPOZ_ERR_OVERLOADED, "overloaded"},
    {PPOZ_ERR_TIMEOUT, "timeout"},
    {PPOZ_ERR_INTERNAL, "internal"},
    {PPOZ_ERR_PROTOCOL, "protocol_error"},
    {PPOZ_ERR_SYSTEM, "system_error"},
    {PPOZ_ERR_INVALID_ARGUMENT, "invalid_argument"},
};
#define N_CODES (sizeof CODES / sizeof CODES[0])

const char *ppoz_strerror(int rc)
{
    for (size_t i = 0; i < N_CODES; i++)
        if (CODES[i].rc == rc)
            return CODES[i].name;
    return "unknown";
}

int ppoz_code_to_rc(const char *code)
{
    /* Only the protocol's closed list (bad_request .. internal), never our local names. */
    for (size_t i = 0; code != NULL && i < N_CODES; i++)
        if (CODES[i].rc <= PPOZ_ERR_BAD_REQUEST && CODES[i].rc >= PPOZ_ERR_INTERNAL && strcmp(CODES[i].name, code) == 0)
            return CODES[i].rc;
    return PPOZ_ERR_PROTOCOL;
}

static const char *const OP_NAMES[] = {
    [PPOZ_OP_ATTACH] = "attach", [PPOZ_OP_DETACH] = "detach",     [PPOZ_OP_ASK] = "ask",
    [PPOZ_OP_STEP] = "step",     [PPOZ_OP_RAG_STEP] = "rag_step", [PPOZ_OP_GENERATE] = "generate",
    [PPOZ_OP_FEEDBACK] = "feedback", [PPOZ_OP_STATUS] = "status", [PPOZ_OP_PING] = "ping",
};

/* A generate reply's finish_reason: the protocol's closed list. */
static const char *const FINISH_REASONS[] = {"eos", "stop", "length"};

const char *ppoz_op_name(ppoz_op op)
{
    if ((int)op < 0 || (size_t)op >= sizeof OP_NAMES / sizeof OP_NAMES[0])
        return NULL;
    return OP_NAMES[op];
}

/* --- Small helpers ---------------------------------------------------------------------- */

static void say(char *buf, size_t cap, const char *fmt, ...)
{
    if (buf == NULL || cap == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
}

/* Record the last error on the client and return rc. */
static int fail(ppoz_client *c, int rc, const char *code, const char *fmt, ...)
{
    snprintf(c->code, sizeof c->code, "%s", code != NULL ? code : ppoz_strerror(rc));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->message, sizeof c->message, fmt, ap);
    va_end(ap);
    return rc;
}

static int succeed(ppoz_client *c)
{
    snprintf(c->code, sizeof c->code, "ok");
    c->message[0] = '\0';
    return PPOZ_OK;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static uint64_t random_u64(void)
{
    uint64_t x = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (f != NULL) {
        size_t got = fread(&x, sizeof x, 1, f);
        fclose(f);
        if (got == 1)
            return x;
    }
    /* No /dev/urandom: mix the clock, the pid and an address (splitmix64). */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    x = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&x;
    x += 0x9e3779b97f4a7c15u;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9u;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebu;
    return x ^ (x >> 31);
}

/* A task_id of the protocol: 1 to 128 of [A-Za-z0-9._:@-]. */
static int valid_task_id(const char *s)
{
    size_t n = strlen(s);
    if (n < 1 || n > PPOZ_MAX_TASK_ID)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        int ok = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '.' ||
                 ch == '_' || ch == ':' || ch == '@' || ch == '-';
        if (!ok)
            return 0;
    }
    return 1;
}

/* The longest prefix of s[0..len) of at most `max` bytes that ends on a UTF-8 character boundary
 * (a cut never leaves the first bytes of a character). */
static size_t utf8_prefix(const char *s, size_t len, size_t max)
{
    if (len <= max)
        return len;
    size_t n = max;
    while (n > 0 && ((unsigned char)s[n] & 0xc0) == 0x80) /* s[n] continues the character before it */
        n--;
    return n;
}

/* --- Encoding --------------------------------------------------------------------------- */

static int pack_cstr(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    return msgpack_pack_str(pk, n) != 0 || msgpack_pack_str_body(pk, s, n) != 0 ? -1 : 0;
}

/* A generate request's prompt or messages and sampling; 0 when they can be encoded, else -1 with the reason. */
static int check_generate(const ppoz_request *req, char *why, size_t why_cap)
{
    int has_messages = req->roles != NULL || req->contents != NULL || req->n_messages > 0;
    if ((req->prompt != NULL) == has_messages) {
        say(why, why_cap, "generate needs exactly one of `prompt` and `messages` (roles and contents), got %s",
            has_messages ? "both" : "neither");
        return -1;
    }
    if (has_messages) {
        if (req->roles == NULL || req->contents == NULL || req->n_messages == 0) {
            say(why, why_cap, "`messages` needs n_messages >= 1 and both `roles` and `contents`, got n_messages %zu, roles %s, contents %s",
                req->n_messages, req->roles == NULL ? "NULL" : "set", req->contents == NULL ? "NULL" : "set");
            return -1;
        }
#if SIZE_MAX > UINT32_MAX
        if (req->n_messages > UINT32_MAX) { /* a msgpack array holds at most 2^32 - 1 items */
            say(why, why_cap, "too many messages: %zu", req->n_messages);
            return -1;
        }
#endif
        for (size_t i = 0; i < req->n_messages; i++) {
            if (req->roles[i] == NULL || req->contents[i] == NULL) {
                say(why, why_cap, "`messages[%zu].%s` is NULL", i, req->roles[i] == NULL ? "role" : "content");
                return -1;
            }
        }
    }
    const ppoz_sampling *s = &req->sampling;
    if (s->max_new_tokens < 1) {
        say(why, why_cap, "`sampling.max_new_tokens` must be at least 1, got %d", s->max_new_tokens);
        return -1;
    }
    if (!isfinite(s->temperature) || s->temperature < 0) {
        say(why, why_cap, "`sampling.temperature` must be a finite number >= 0 (0 is greedy), got %g", s->temperature);
        return -1;
    }
    if (!(s->top_p > 0 && s->top_p <= 1)) { /* NaN fails too */
        say(why, why_cap, "`sampling.top_p` must be in (0, 1], got %g", s->top_p);
        return -1;
    }
    if (s->n_stop > 0 && s->stop == NULL) {
        say(why, why_cap, "`sampling.stop` is NULL with n_stop %zu", s->n_stop);
        return -1;
    }
#if SIZE_MAX > UINT32_MAX
    if (s->n_stop > UINT32_MAX) {
        say(why, why_cap, "too many stop strings: %zu", s->n_stop);
        return -1;
    }
#endif
    for (size_t i = 0; i < s->n_stop; i++) {
        if (s->stop[i] == NULL || s->stop[i][0] == '\0') {
            say(why, why_cap, "`sampling.stop[%zu]` must be a non-empty string, got %s", i, s->stop[i] == NULL ? "NULL" : "\"\"");
            return -1;
        }
    }
    if (s->has_seed && s->seed < 0) {
        say(why, why_cap, "`sampling.seed` must be from 0 to 2^63 - 1, got %" PRId64, s->seed);
        return -1;
    }
    return 0;
}

/* Check a request's fields for its op; 0 when it can be encoded, else -1 with the reason. */
static int check_request(const ppoz_request *req, char *why, size_t why_cap)
{
    const char *op = ppoz_op_name(req->op);
    if (op == NULL) {
        say(why, why_cap, "unknown op %d", (int)req->op);
        return -1;
    }
    if (req->rid == NULL || req->rid[0] == '\0' || strlen(req->rid) > PPOZ_MAX_RID_BYTES) {
        say(why, why_cap, "`rid` must be 1 to %d bytes", PPOZ_MAX_RID_BYTES);
        return -1;
    }
    int uses_task = req->op != PPOZ_OP_STATUS && req->op != PPOZ_OP_PING;
    if (uses_task && req->task_id == NULL && req->op != PPOZ_OP_ATTACH) {
        say(why, why_cap, "%s needs a `task_id`", op);
        return -1;
    }
    if (uses_task && req->task_id != NULL && !valid_task_id(req->task_id)) {
        say(why, why_cap, "`task_id` must be 1 to %d of [A-Za-z0-9._:@-], got \"%.40s\"", PPOZ_MAX_TASK_ID, req->task_id);
        return -1;
    }
    if (req->op == PPOZ_OP_STEP || req->op == PPOZ_OP_RAG_STEP) {
        if (req->prompt == NULL) {
            say(why, why_cap, "%s needs a `prompt` (not NULL)", op);
            return -1;
        }
        if (req->actions == NULL || req->n_actions == 0) {
            say(why, why_cap, "%s needs at least one candidate action, got %zu", op,
                req->actions == NULL ? (size_t)0 : req->n_actions);
            return -1;
        }
#if SIZE_MAX > UINT32_MAX
        if (req->n_actions > UINT32_MAX) { /* a msgpack array holds at most 2^32 - 1 items */
            say(why, why_cap, "too many candidate actions: %zu", req->n_actions);
            return -1;
        }
#endif
        for (size_t i = 0; i < req->n_actions; i++) {
            if (req->actions[i] == NULL) {
                say(why, why_cap, "candidate action %zu is NULL", i);
                return -1;
            }
        }
    }
    if (req->op == PPOZ_OP_GENERATE && check_generate(req, why, why_cap) != 0)
        return -1;
    if ((req->op == PPOZ_OP_STEP || req->op == PPOZ_OP_RAG_STEP || req->op == PPOZ_OP_GENERATE) && req->deadline_ms < 0) {
        say(why, why_cap, "`deadline_ms` must be positive (or 0 to leave it out), got %d", req->deadline_ms);
        return -1;
    }
    if (req->op == PPOZ_OP_FEEDBACK && !isfinite(req->reward)) {
        say(why, why_cap, "`reward` must be finite, got %g", req->reward);
        return -1;
    }
    return 0;
}

int ppoz_encode_request(const ppoz_request *req, char **out, size_t *out_len, char *why, size_t why_cap)
{
    if (req == NULL || out == NULL || out_len == NULL) {
        say(why, why_cap, "ppoz_encode_request: `req`, `out` and `out_len` must not be NULL");
        return PPOZ_ERR_INVALID_ARGUMENT;
    }
    *out = NULL;
    *out_len = 0;
    if (check_request(req, why, why_cap) != 0)
        return PPOZ_ERR_INVALID_ARGUMENT;

    int is_step = req->op == PPOZ_OP_STEP || req->op == PPOZ_OP_RAG_STEP;
    int with_task = req->task_id != NULL && req->op != PPOZ_OP_STATUS && req->op != PPOZ_OP_PING;
    uint32_t n_fields = 4 + (with_task ? 1 : 0);
    if (is_step)
        n_fields += 1 + (req->deadline_ms > 0 ? 1 : 0);
    if (req->op == PPOZ_OP_GENERATE)
        n_fields += 2 + (req->deadline_ms > 0 ? 1 : 0); /* prompt or messages, sampling */
    if (req->op == PPOZ_OP_FEEDBACK)
        n_fields += 3;

    msgpack_sbuffer buf;
    msgpack_sbuffer_init(&buf);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);

    /* Same keys, same order as the Python side (client/retry.py build_request + the op's fields). */
    int err = msgpack_pack_map(&pk, n_fields);
    err |= pack_cstr(&pk, "proto") | pack_cstr(&pk, PROTOCOL_ID);
    err |= pack_cstr(&pk, "v") | msgpack_pack_int(&pk, PPOZ_PROTOCOL_VERSION);
    err |= pack_cstr(&pk, "op") | pack_cstr(&pk, ppoz_op_name(req->op));
    err |= pack_cstr(&pk, "rid") | pack_cstr(&pk, req->rid);
    if (with_task)
        err |= pack_cstr(&pk, "task_id") | pack_cstr(&pk, req->task_id);
    if (is_step) {
        err |= pack_cstr(&pk, "obs") | msgpack_pack_map(&pk, req->question != NULL ? 3 : 2);
        err |= pack_cstr(&pk, "prompt") | pack_cstr(&pk, req->prompt);
        if (req->question != NULL)
            err |= pack_cstr(&pk, "question") | pack_cstr(&pk, req->question);
        err |= pack_cstr(&pk, "action") | msgpack_pack_array(&pk, req->n_actions);
        for (size_t i = 0; i < req->n_actions; i++)
            err |= pack_cstr(&pk, req->actions[i]);
        if (req->deadline_ms > 0)
            err |= pack_cstr(&pk, "deadline_ms") | msgpack_pack_int(&pk, req->deadline_ms);
    }
    if (req->op == PPOZ_OP_GENERATE) {
        /* the documented order: prompt or messages, sampling {max_new_tokens, temperature, top_p, stop, seed}, deadline_ms */
        if (req->prompt != NULL) {
            err |= pack_cstr(&pk, "prompt") | pack_cstr(&pk, req->prompt);
        } else {
            err |= pack_cstr(&pk, "messages") | msgpack_pack_array(&pk, req->n_messages);
            for (size_t i = 0; i < req->n_messages; i++) {
                err |= msgpack_pack_map(&pk, 2);
                err |= pack_cstr(&pk, "role") | pack_cstr(&pk, req->roles[i]);
                err |= pack_cstr(&pk, "content") | pack_cstr(&pk, req->contents[i]);
            }
        }
        const ppoz_sampling *s = &req->sampling;
        err |= pack_cstr(&pk, "sampling") | msgpack_pack_map(&pk, 3 + (s->n_stop > 0 ? 1 : 0) + (s->has_seed ? 1 : 0));
        err |= pack_cstr(&pk, "max_new_tokens") | msgpack_pack_int(&pk, s->max_new_tokens);
        err |= pack_cstr(&pk, "temperature") | msgpack_pack_double(&pk, s->temperature);
        err |= pack_cstr(&pk, "top_p") | msgpack_pack_double(&pk, s->top_p);
        if (s->n_stop > 0) {
            err |= pack_cstr(&pk, "stop") | msgpack_pack_array(&pk, s->n_stop);
            for (size_t i = 0; i < s->n_stop; i++)
                err |= pack_cstr(&pk, s->stop[i]);
        }
        if (s->has_seed)
            err |= pack_cstr(&pk, "seed") | msgpack_pack_int64(&pk, s->seed);
        if (req->deadline_ms > 0)
            err |= pack_cstr(&pk, "deadline_ms") | msgpack_pack_int(&pk, req->deadline_ms);
    }
    if (req->op == PPOZ_OP_FEEDBACK) {
        err |= pack_cstr(&pk, "reward") | msgpack_pack_double(&pk, req->reward);
        err |= pack_cstr(&pk, "done") | (req->done ? msgpack_pack_true(&pk) : msgpack_pack_false(&pk));
        err |= pack_cstr(&pk, "truncated") | (req->truncated ? msgpack_pack_true(&pk) : msgpack_pack_false(&pk));
    }
    if (err != 0) {
        msgpack_sbuffer_destroy(&buf);
        say(why, why_cap, "out of memory encoding a %s request", ppoz_op_name(req->op));
        return PPOZ_ERR_SYSTEM;
    }
    *out_len = buf.size; /* read before the release, which zeroes it */
    *out = msgpack_sbuffer_release(&buf); /* malloc'd by the sbuffer: the caller free()s it */
    if (*out == NULL) { /* an empty buffer cannot happen: a map header is always written */
        say(why, why_cap, "empty encoding");
        return PPOZ_ERR_SYSTEM;
    }
    return PPOZ_OK;
}

/* --- Parsing replies -------------------------------------------------------------------- */

static int key_is(const msgpack_object *key, const char *name)
{
    size_t n = strlen(name);
    return key->type == MSGPACK_OBJECT_STR && key->via.str.size == n && memcmp(key->via.str.ptr, name, n) == 0;
}

/* Copy a str into a fixed buffer, cut to fit. 0 if it is a str, -1 otherwise. */
static int copy_str(const msgpack_object *o, char *dst, size_t cap)
{
    if (o->type != MSGPACK_OBJECT_STR)
        return -1;
    size_t n = o->via.str.size < cap - 1 ? o->via.str.size : cap - 1;
    memcpy(dst, o->via.str.ptr, n);
    dst[n] = '\0';
    return 0;
}

static int get_int(const msgpack_object *o, int64_t *v)
{
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= (uint64_t)INT64_MAX) {
        *v = (int64_t)o->via.u64;
        return 0;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *v = o->via.i64;
        return 0;
    }
    return -1;
}

static int get_number(const msgpack_object *o, double *v)
{
    int64_t i;
    if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64) {
        *v = o->via.f64;
        return 0;
    }
    if (get_int(o, &i) == 0) {
        *v = (double)i;
        return 0;
    }
    return -1;
}

static int get_bool(const msgpack_object *o, int *v)
{
    if (o->type != MSGPACK_OBJECT_BOOLEAN)
        return -1;
    *v = o->via.boolean ? 1 : 0;
    return 0;
}

static int parse_error_map(const msgpack_object *o, ppoz_reply *out, char *why, size_t why_cap)
{
    if (o->type != MSGPACK_OBJECT_MAP) {
        say(why, why_cap, "`error` is not a map");
        return -1;
    }
    out->is_error = 1;
    for (uint32_t i = 0; i < o->via.map.size; i++) {
        const msgpack_object *k = &o->via.map.ptr[i].key, *v = &o->via.map.ptr[i].val;
        if (key_is(k, "code") && copy_str(v, out->error_code, sizeof out->error_code) != 0) {
            say(why, why_cap, "`error.code` is not a str");
            return -1;
        }
        if (key_is(k, "message") && v->type != MSGPACK_OBJECT_NIL &&
            copy_str(v, out->error_message, sizeof out->error_message) != 0) {
            say(why, why_cap, "`error.message` is not a str");
            return -1;
        }
    }
    if (out->error_code[0] == '\0') {
        say(why, why_cap, "`error` has no `code`");
        return -1;
    }
    return 0;
}

/* One field of a reply map; -1 (with the reason) when a known field has the wrong type. */
static int parse_field(const msgpack_object *k, const msgpack_object *v, ppoz_reply *out, char *why, size_t why_cap)
{
    if (k->type != MSGPACK_OBJECT_STR || v->type == MSGPACK_OBJECT_NIL)
        return 0; /* nil: as if absent (an error reply's rid or op may be nil) */
    const char *bad = NULL;
    if (key_is(k, "op")) {
        if (copy_str(v, out->op, sizeof out->op) != 0)
            bad = "`op` is not a str";
    } else if (key_is(k, "rid")) {
        const char *ptr = v->type == MSGPACK_OBJECT_STR ? v->via.str.ptr : v->type == MSGPACK_OBJECT_BIN ? v->via.bin.ptr : NULL;
        size_t n = v->type == MSGPACK_OBJECT_STR ? v->via.str.size : v->type == MSGPACK_OBJECT_BIN ? v->via.bin.size : 0;
        if (v->type != MSGPACK_OBJECT_STR && v->type != MSGPACK_OBJECT_BIN)
            bad = "`rid` is not a str or bin";
        else if (n < 1 || n > PPOZ_MAX_RID_BYTES)
            bad = "`rid` is not 1 to 64 bytes";
        else {
            memcpy(out->rid, ptr, n);
            out->rid[n] = '\0';
            out->rid_len = n;
            out->has_rid = 1;
        }
    } else if (key_is(k, "status")) {
        if (copy_str(v, out->status, sizeof out->status) != 0)
            bad = "`status` is not a str";
    } else if (key_is(k, "task_id")) {
        if (v->type != MSGPACK_OBJECT_STR || v->via.str.size > PPOZ_MAX_TASK_ID)
            bad = "`task_id` is not a str of at most 128 bytes";
        else {
            copy_str(v, out->task_id, sizeof out->task_id);
            out->has_task_id = 1;
        }
    } else if (key_is(k, "error")) {
        return parse_error_map(v, out, why, why_cap);
    } else if (key_is(k, "retry_after_ms")) {
        double ms;
        if (get_number(v, &ms) != 0 || !isfinite(ms))
            bad = "`retry_after_ms` is not a number";
        else {
            out->retry_after_ms = ms < 0 ? 0 : ms > 86400000.0 ? 86400000 : (int64_t)ms;
            out->has_retry_after_ms = 1;
        }
    } else if (key_is(k, "reason")) {
        if (copy_str(v, out->reason, sizeof out->reason) != 0)
            bad = "`reason` is not a str";
    } else if (key_is(k, "action")) {
        if (get_int(v, &out->action) != 0)
            bad = "`action` is not an int";
        else
            out->has_action = 1;
    } else if (key_is(k, "logprob")) {
        if (get_number(v, &out->logprob) != 0)
            bad = "`logprob` is not a number";
        else
            out->has_logprob = 1;
    } else if (key_is(k, "probs")) {
        if (v->type != MSGPACK_OBJECT_ARRAY)
            bad = "`probs` is not an array";
        else
            out->n_probs = v->via.array.size;
    } else if (key_is(k, "policy_version")) {
        if (get_int(v, &out->policy_version) != 0)
            bad = "`policy_version` is not an int";
        else
            out->has_policy_version = 1;
    } else if (key_is(k, "resumed")) {
        if (get_bool(v, &out->resumed) != 0)
            bad = "`resumed` is not a bool";
    } else if (key_is(k, "segment_closed")) {
        if (get_bool(v, &out->segment_closed) != 0)
            bad = "`segment_closed` is not a bool";
    } else if (key_is(k, "dropped_pending_step")) {
        if (get_bool(v, &out->dropped_pending_step) != 0)
            bad = "`dropped_pending_step` is not a bool";
    } else if (key_is(k, "segments_closed")) {
        if (get_int(v, &out->segments_closed) != 0)
            bad = "`segments_closed` is not an int";
    } else if (key_is(k, "time_ms")) {
        double t;
        if (get_number(v, &t) != 0)
            bad = "`time_ms` is not a number";
        else {
            out->time_ms = (int64_t)t;
            out->has_time_ms = 1;
        }
    } else if (key_is(k, "text")) {
        if (v->type != MSGPACK_OBJECT_STR)
            bad = "`text` is not a str";
        else {
            out->text_full_len = v->via.str.size;
            out->text_len = utf8_prefix(v->via.str.ptr, v->via.str.size, sizeof out->text - 1);
            memcpy(out->text, v->via.str.ptr, out->text_len);
            out->text[out->text_len] = '\0';
            out->text_truncated = out->text_len < out->text_full_len;
            out->has_text = 1;
        }
    } else if (key_is(k, "n_tokens")) {
        if (get_int(v, &out->n_tokens) != 0)
            bad = "`n_tokens` is not an int";
        else
            out->has_n_tokens = 1;
    } else if (key_is(k, "finish_reason")) {
        if (copy_str(v, out->finish_reason, sizeof out->finish_reason) != 0)
            bad = "`finish_reason` is not a str";
    }
    if (bad != NULL) {
        say(why, why_cap, "%s", bad);
        return -1;
    }
    return 0;
}

int ppoz_parse_reply(const void *data, size_t len, ppoz_reply *out, char *why, size_t why_cap)
{
    if (out == NULL || (data == NULL && len > 0)) {
        say(why, why_cap, "ppoz_parse_reply: `data` and `out` must not be NULL");
        return PPOZ_ERR_INVALID_ARGUMENT;
    }
    memset(out, 0, sizeof *out);
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    int rc = PPOZ_OK;
    msgpack_unpack_return r = msgpack_unpack_next(&u, (const char *)data, len, &off);
    if (r != MSGPACK_UNPACK_SUCCESS) {
        say(why, why_cap, "the reply is not valid msgpack (%s)", r == MSGPACK_UNPACK_CONTINUE ? "truncated" : "malformed");
        rc = PPOZ_ERR_PROTOCOL;
    } else if (off != len) {
        say(why, why_cap, "the reply has %zu bytes after its msgpack object", len - off);
        rc = PPOZ_ERR_PROTOCOL;
    } else if (u.data.type != MSGPACK_OBJECT_MAP) {
        say(why, why_cap, "the reply is not a msgpack map");
        rc = PPOZ_ERR_PROTOCOL;
    } else {
        const msgpack_object_map *m = &u.data.via.map;
        for (uint32_t i = 0; i < m->size && rc == PPOZ_OK; i++)
            if (parse_field(&m->ptr[i].key, &m->ptr[i].val, out, why, why_cap) != 0)
                rc = PPOZ_ERR_PROTOCOL;
    }
    msgpack_unpacked_destroy(&u);
    return rc;
}

/* --- Sockets ---------------------------------------------------------------------------- */

static int open_socket(ppoz_client *c)
{
    int linger = 0;
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    if (c->sock == NULL)
        return -1;
    if (zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger) != 0 || zmq_connect(c->sock, c->endpoint) != 0) {
        int e = errno;
        zmq_close(c->sock);
        c->sock = NULL;
        errno = e;
        return -1;
    }
    return 0;
}

/* Drop the socket: whatever the dead connection had queued goes with it (LINGER 0). */
static void reset_socket(ppoz_client *c)
{
    if (c->sock != NULL) {
        zmq_close(c->sock);
        c->sock = NULL;
    }
}

ppoz_client *ppoz_open(const char *endpoint, int deadline_ms, int attempt_timeout_ms)
{
    if (endpoint == NULL || endpoint[0] == '\0' || deadline_ms <= 0 || attempt_timeout_ms <= 0) {
        errno = EINVAL;
        return NULL;
    }
    ppoz_client *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->endpoint = strdup(endpoint);
    c->ctx = zmq_ctx_new();
    if (c->endpoint == NULL || c->ctx == NULL || open_socket(c) != 0) { /* connect now: a bad endpoint fails here */
        int e = errno;
        ppoz_close(c);
        errno = e;
        return NULL;
    }
    c->deadline_ms = deadline_ms;
    c->attempt_timeout_ms = attempt_timeout_ms;
    c->rid_prefix = random_u64();
    succeed(c);
    return c;
}

void ppoz_close(ppoz_client *c)
{
    if (c == NULL)
        return;
    reset_socket(c);
    if (c->ctx != NULL)
        zmq_ctx_term(c->ctx); /* prompt: every socket had LINGER 0 */
    free(c->endpoint);
    free(c);
}

const char *ppoz_error_code(const ppoz_client *c)
{
    return c != NULL ? c->code : "invalid_argument";
}

const char *ppoz_error_message(const ppoz_client *c)
{
    return c != NULL ? c->message : "the client is NULL";
}

unsigned long ppoz_attempts(const ppoz_client *c)
{
    return c != NULL ? c->attempts : 0;
}

const ppoz_reply *ppoz_last_reply(const ppoz_client *c)
{
    return c != NULL && c->has_reply ? &c->reply : NULL;
}

/* --- One request, with the retry rule --------------------------------------------------- */

/* Send `data` once and wait up to `timeout_ms` for the reply carrying `rid`.
 * 1: c->reply holds it; 0: no reply (the caller replaces the socket); -1: a ZeroMQ failure. */
static int attempt(ppoz_client *c, const char *rid, const char *data, size_t len, int timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    /* A DEALER that connected queues at once; SNDTIMEO only bounds a full queue (HWM). */
    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &timeout_ms, sizeof timeout_ms);
    while (zmq_send(c->sock, "", 0, ZMQ_SNDMORE) < 0) {
        if (errno == EAGAIN)
            return 0;
        if (errno != EINTR)
            return -1;
    }
    while (zmq_send(c->sock, data, len, 0) < 0) {
        if (errno == EAGAIN)
            return 0;
        if (errno != EINTR)
            return -1;
    }
    c->attempts++;
    size_t rid_len = strlen(rid);
    for (;;) {
        int64_t left = end - now_ms();
        if (left <= 0)
            return 0;
        zmq_pollitem_t item = {c->sock, 0, ZMQ_POLLIN, 0};
        int n = zmq_poll(&item, 1, (long)left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -1;
        if (n == 0)
            return 0;
        /* A whole multipart message is there: read its frames and keep the last (the body). */
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        for (;;) {
            if (zmq_msg_recv(&msg, c->sock, 0) < 0) {
                if (errno == EINTR)
                    continue;
                int e = errno;
                zmq_msg_close(&msg);
                errno = e;
                return -1;
            }
            if (!zmq_msg_more(&msg))
                break;
        }
        ppoz_reply *reply = &c->scratch;
        int ok = ppoz_parse_reply(zmq_msg_data(&msg), zmq_msg_size(&msg), reply, NULL, 0) == PPOZ_OK;
        zmq_msg_close(&msg);
        /* Its own rid; or rid nil on an error: the broker could not read this request's rid (protocol
         * section 4), and this client has one request in flight per socket (an attempt without reply
         * replaces the socket), so that reply can only be this request's. */
        if (ok && ((reply->has_rid && reply->rid_len == rid_len && memcmp(reply->rid, rid, rid_len) == 0) ||
                   (!reply->has_rid && reply->is_error))) {
            c->reply = *reply;
            c->has_reply = 1;
            return 1;
        }
        /* unreadable, or the late answer to an earlier request: ignore it */
    }
}

static int is_retried(int rc)
{
    return rc == PPOZ_ERR_OVERLOADED || rc == PPOZ_ERR_TIMEOUT || rc == PPOZ_ERR_INTERNAL;
}

/* Send one request (a fresh rid, kept across attempts) until a final reply or the deadline. */
static int request(ppoz_client *c, ppoz_request *req)
{
    char rid[PPOZ_MAX_RID_BYTES + 1];
    snprintf(rid, sizeof rid, "%016" PRIx64 "-%" PRIu64, c->rid_prefix, ++c->rid_counter);
    req->rid = rid;
    const char *op = ppoz_op_name(req->op);
    char *data = NULL;
    size_t len = 0;
    char why[256] = "";
    int rc = ppoz_encode_request(req, &data, &len, why, sizeof why);
    if (rc != PPOZ_OK)
        return fail(c, rc, NULL, "%s", why);

    int64_t end = now_ms() + c->deadline_ms;
    unsigned long sent = 0;
    for (;;) {
        int64_t remaining = end - now_ms();
        if (remaining <= 0) {
            rc = fail(c, PPOZ_ERR_TIMEOUT, NULL, "no reply to %s within %d ms (%lu attempts to %s)", op,
                      c->deadline_ms, sent, c->endpoint);
            break;
        }
        if (c->sock == NULL && open_socket(c) != 0) {
            rc = fail(c, PPOZ_ERR_SYSTEM, NULL, "cannot open a socket to %s: %s", c->endpoint, zmq_strerror(errno));
            break;
        }
        int timeout = (int)(remaining < c->attempt_timeout_ms ? remaining : c->attempt_timeout_ms);
        unsigned long before = c->attempts;
        int got = attempt(c, rid, data, len, timeout);
        sent += c->attempts - before;
        if (got < 0) {
            rc = fail(c, PPOZ_ERR_SYSTEM, NULL, "%s to %s failed: %s", op, c->endpoint, zmq_strerror(errno));
            break;
        }
        if (got == 0) {
            reset_socket(c); /* a lost connection: the same bytes go again on a fresh socket */
            continue;
        }
        if (!c->reply.is_error) {
            rc = succeed(c);
            break;
        }
        rc = ppoz_code_to_rc(c->reply.error_code);
        fail(c, rc, c->reply.error_code, "%s", c->reply.error_message);
        if (!is_retried(rc) || !c->reply.has_rid)
            break; /* rid nil is final: the same bytes would get the same answer */
        int64_t wait = c->reply.has_retry_after_ms ? c->reply.retry_after_ms : PPOZ_DEFAULT_RETRY_AFTER_MS;
        if (wait >= end - now_ms())
            break; /* waiting would end past the deadline: report the broker's reason */
        sleep_ms(wait);
    }
    free(data);
    return rc;
}

/* --- The operations --------------------------------------------------------------------- */

#define CHECK_CLIENT(c)                                                                                                \
    do {                                                                                                               \
        if ((c) == NULL)                                                                                               \
            return PPOZ_ERR_INVALID_ARGUMENT;                                                                          \
    } while (0)

static int expect_status(ppoz_client *c, const char *op, const char *status)
{
    if (strcmp(c->reply.status, status) != 0)
        return fail(c, PPOZ_ERR_PROTOCOL, NULL, "%s reply has status \"%s\", expected \"%s\"", op, c->reply.status, status);
    return PPOZ_OK;
}

static int check_task_arg(ppoz_client *c, const char *func, const char *task_id)
{
    if (task_id == NULL)
        return fail(c, PPOZ_ERR_INVALID_ARGUMENT, NULL, "%s: `task_id` is NULL", func);
    if (!valid_task_id(task_id))
        return fail(c, PPOZ_ERR_INVALID_ARGUMENT, NULL, "%s: `task_id` must be 1 to %d of [A-Za-z0-9._:@-], got \"%.40s\"",
                    func, PPOZ_MAX_TASK_ID, task_id);
    return PPOZ_OK;
}

int ppoz_attach(ppoz_client *c, char *task_id, size_t cap)
{
    CHECK_CLIENT(c);
    if (task_id == NULL)
        return fail(c, PPOZ_ERR_INVALID_ARGUMENT, NULL, "ppoz_attach: `task_id` is NULL (pass \"\" to let the broker choose)");
    if (cap < PPOZ_TASK_ID_CAP)
        return fail(c, PPOZ_ERR_INVALID_ARGUMENT, NULL,
                    "ppoz_attach: `cap` must be at least PPOZ_TASK_ID_CAP (%d) to hold any task id, got %zu", PPOZ_TASK_ID_CAP,
                    cap);
    if (memchr(task_id, '\0', cap) == NULL)
        return fail(c, PPOZ_ERR_INVALID_ARGUMENT, NULL, "ppoz_attach: `task_id` is not NUL-terminated within `cap`");
    if (task_id[0] != '\0') {
        int rc = check_task_arg(c, "ppoz_attach", task_id);
        if (rc != PPOZ_OK)
            return rc;
    }
    ppoz_request req = {.op = PPOZ_OP_ATTACH, .task_id = task_id[0] != '\0' ? task_id : NULL};
    int rc = request(c, &req);
    if (rc != PPOZ_OK)
        return rc;
    if ((rc = expect_status(c, "attach", "attached")) != PPOZ_OK)
        return rc;
    if (!c->reply.has_task_id || !valid_task_id(c->reply.task_id))
        return fail(c, PPOZ_ERR_PROTOCOL, NULL, "attach reply has no valid `task_id`");
    snprintf(task_id, cap, "%s", c->reply.task_id);
    return PPOZ_OK;
}

int ppoz_ask(ppoz_client *c, const char *task_id, int *ready, int *retry_after_ms)
{
    CHECK_CLIENT(c);
    int rc = check_task_arg(c, "ppoz_ask", task_id);
    if (rc != PPOZ_OK)
        return rc;
    if (ready == NULL)
        return fail(c, PPOZ_ERR_INVALID_ARGUMENT, NULL, "ppoz_ask: `ready` is NULL");
    ppoz_request req = {.op = PPOZ_OP_ASK, .task_id = task_id};
    if ((rc = request(c, &req)) != PPOZ_OK)
        return rc;
    int wait_ms = 0;
    if (strcmp(c->reply.status, "ok") == 0) {
        *ready = 1;
    } else if (strcmp(c->reply.status, "wait") == 0) {
        *ready = 0;
        wait_ms = c->reply.has_retry_after_ms ? (int)c->reply.retry_after_ms : PPOZ_DEFAULT_RETRY_AFTER_MS;
    } else {
        return fail(c, PPOZ_ERR_PROTOCOL, NULL, "ask reply has status \"%s\", expected \"ok\" or \"wait\"", c->reply.status);
    }
    if (retry_after_ms != NULL)
        *retry_after_ms = wait_ms;
    return PPOZ_OK;
}

int ppoz_step(ppoz_client *c, const char *task_id, const char *prompt, const char *question,
              const char *const *actions, size_t n_actions, int *action, int *policy_version)
{
    CHECK_CLIENT(c);
    int rc = check_task_arg(c, "ppoz_step", task_id);
    if (rc != PPOZ_OK)
        return rc;
    ppoz_request req = {.op = PPOZ_OP_STEP, .task_id = task_id, .prompt = prompt, .question = question,
                        .actions = actions, .n_actions = n_actions};
    if ((rc = request(c, &req)) != PPOZ_OK)
        return rc; /* argument errors (NULL prompt, no actions) come back from the encoder, named */
    if ((rc = expect_status(c, "step", "ok")) != PPOZ_OK)
        return rc;
    if (!c->reply.has_action || c->reply.action < 0 || (uint64_t)c->reply.action >= n_actions)
        return fail(c, PPOZ_ERR_PROTOCOL, NULL, "step reply: `action` missing or not an index into %zu candidates", n_actions);
    if (!c->reply.has_policy_version || c->reply.policy_version < INT_MIN || c->reply.policy_version > INT_MAX)
        return fail(c, PPOZ_ERR_PROTOCOL, NULL, "step reply: `policy_version` missing or out of range");
    if (action != NULL)
        *action = (int)c->reply.action;
    if (policy_version != NULL)
        *policy_version = (int)c->reply.policy_version;
    return PPOZ_OK;
}

int ppoz_generate(ppoz_client *c, const char *task_id, const char *prompt, const char *const *roles,
                  const char *const *contents, size_t n_messages, const ppoz_sampling *sampling, int deadline_ms,
                  char *text, size_t text_cap, size_t *text_len, int *n_tokens, const char **finish_reason,
                  int *policy_version)
{
    CHECK_CLIENT(c);
    int rc = check_task_arg(c, "ppoz_generate", task_id);
    if (rc != PPOZ_OK)
        return rc;
    if (sampling == NULL)
        return fail(c, PPOZ_ERR_INVALID_ARGUMENT, NULL, "ppoz_generate: `sampling` is NULL");
    if (text == NULL && text_cap > 0)
        return fail(c, PPOZ_ERR_INVALID_ARGUMENT, NULL, "ppoz_generate: `text` is NULL with text_cap %zu", text_cap);
    ppoz_request req = {.op = PPOZ_OP_GENERATE, .task_id = task_id, .prompt = prompt, .roles = roles, .contents = contents,
                        .n_messages = n_messages, .sampling = *sampling, .deadline_ms = deadline_ms};
    if ((rc = request(c, &req)) != PPOZ_OK)
        return rc; /* argument errors (prompt and messages, the sampling ranges) come back from the encoder, named */
    if ((rc = expect_status(c, "generate", "ok")) != PPOZ_OK)
        return rc;
    const ppoz_reply *r = &c->reply;
    if (!r->has_text)
        return fail(c, PPOZ_ERR_PROTOCOL, NULL, "generate reply: `text` missing");
    if (!r->has_n_tokens || r->n_tokens < 0 || r->n_tokens > INT_MAX)
        return fail(c, PPOZ_ERR_PROTOCOL, NULL, "generate reply: `n_tokens` missing or out of range");
    const char *reason = NULL;
    for (size_t i = 0; i < sizeof FINISH_REASONS / sizeof FINISH_REASONS[0]; i++)
        if (strcmp(r->finish_reason, FINISH_REASONS[i]) == 0)
            reason = FINISH_REASONS[i];
    if (reason == NULL)
        return fail(c, PPOZ_ERR_PROTOCOL, NULL, "generate reply: `finish_reason` \"%s\" is not eos, stop or length",
                    r->finish_reason);
    if (!r->has_policy_version || r->policy_version < INT_MIN || r->policy_version > INT_MAX)
        return fail(c, PPOZ_ERR_PROTOCOL, NULL, "generate reply: `policy_version` missing or out of range");
    if (text_cap > 0) {
        size_t n = utf8_prefix(r->text, r->text_len, text_cap - 1);
        memcpy(text, r->text, n);
        text[n] = '\0';
    }
    if (text_len != NULL)
        *text_len = r->text_full_len;
    if (n_tokens != NULL)
        *n_tokens = (int)r->n_tokens;
    if (finish_reason != NULL)
        *finish_reason = reason;
    if (policy_version != NULL)
        *policy_version = (int)r->policy_version;
    return PPOZ_OK;
}

int ppoz_feedback(ppoz_client *c, const char *task_id, double reward, int done, int truncated)
{
    CHECK_CLIENT(c);
    int rc = check_task_arg(c, "ppoz_feedback", task_id);
    if (rc != PPOZ_OK)
        return rc;
    ppoz_request req = {.op = PPOZ_OP_FEEDBACK, .task_id = task_id, .reward = reward, .done = done, .truncated = truncated};
    if ((rc = request(c, &req)) != PPOZ_OK)
        return rc;
    return expect_status(c, "feedback", "ok");
}

int ppoz_detach(ppoz_client *c, const char *task_id)
{
    CHECK_CLIENT(c);
    int rc = check_task_arg(c, "ppoz_detach", task_id);
    if (rc != PPOZ_OK)
        return rc;
    ppoz_request req = {.op = PPOZ_OP_DETACH, .task_id = task_id};
    if ((rc = request(c, &req)) != PPOZ_OK)
        return rc;
    return expect_status(c, "detach", "detached");
}

int ppoz_ping(ppoz_client *c, int64_t *time_ms)
{
    CHECK_CLIENT(c);
    ppoz_request req = {.op = PPOZ_OP_PING};
    int rc = request(c, &req);
    if (rc != PPOZ_OK)
        return rc;
    if ((rc = expect_status(c, "ping", "ok")) != PPOZ_OK)
        return rc;
    if (time_ms != NULL)
        *time_ms = c->reply.time_ms;
    return PPOZ_OK;
}
