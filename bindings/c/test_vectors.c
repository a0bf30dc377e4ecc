/*
 * test_vectors: the C client against conformance/vectors (the worked examples of docs/protocol.md).
 *
 *   test_vectors VECTORS_DIR
 *
 * 1. Every NAME.msgpack decodes with msgpack-c and re-encodes to the same bytes.
 * 2. Every documented request, built with ppoz_encode_request, equals its vector byte for byte.
 * 3. Every documented reply parses with ppoz_parse_reply to the documented fields.
 * Prints one line per failure and a summary; exits 1 on any failure.
 */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "ppoz.h"

static int failures = 0;

static void failed(const char *name, const char *fmt, const char *detail)
{
    printf("FAIL %s: ", name);
    printf(fmt, detail);
    printf("\n");
    failures++;
}

/* The whole file, malloc'd; NULL if it cannot be read. */
static char *read_file(const char *dir, const char *name, const char *suffix, size_t *len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s%s", dir, name, suffix);
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    char *data = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (data = malloc((size_t)n + 1)) != NULL) {
            if (fread(data, 1, (size_t)n, f) != (size_t)n) {
                free(data);
                data = NULL;
            } else {
                *len = (size_t)n;
            }
        }
    }
    fclose(f);
    return data;
}

/* Report where two encodings first differ. */
static int same_bytes(const char *name, const char *what, const char *got, size_t got_len, const char *want, size_t want_len)
{
    if (got_len == want_len && memcmp(got, want, got_len) == 0)
        return 1;
    size_t i = 0;
    while (i < got_len && i < want_len && got[i] == want[i])
        i++;
    char detail[160];
    snprintf(detail, sizeof detail, "%s: %zu bytes vs %zu expected, first difference at byte %zu (0x%02x vs 0x%02x)", what,
             got_len, want_len, i, i < got_len ? (unsigned char)got[i] : 0, i < want_len ? (unsigned char)want[i] : 0);
    failed(name, "%s", detail);
    return 0;
}

/* --- 1. Round trips --------------------------------------------------------------------- */

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int round_trip(const char *dir, const char *name)
{
    size_t len = 0;
    char *data = read_file(dir, name, ".msgpack", &len);
    if (data == NULL) {
        failed(name, "%s", "cannot read the .msgpack file");
        return 0;
    }
    int ok = 0;
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    if (msgpack_unpack_next(&u, data, len, &off) != MSGPACK_UNPACK_SUCCESS || off != len) {
        failed(name, "%s", "does not decode as exactly one msgpack object");
    } else if (u.data.type != MSGPACK_OBJECT_MAP) {
        failed(name, "%s", "is not a msgpack map");
    } else {
        msgpack_sbuffer buf;
        msgpack_sbuffer_init(&buf);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
        if (msgpack_pack_object(&pk, u.data) != 0)
            failed(name, "%s", "cannot re-encode the decoded object");
        else
            ok = same_bytes(name, "re-encoded", buf.data, buf.size, data, len);
        msgpack_sbuffer_destroy(&buf);
    }
    msgpack_unpacked_destroy(&u);
    free(data);
    return ok;
}

/* --- 2. Requests ------------------------------------------------------------------------ */

static const char *const STEP_ACTIONS[] = {"0: TouchEvent(Cart)", "1: KeyEvent(BACK)"};
static const char *const GENERATE_STOP[] = {"\n"};
static const char *const GENERATE_ROLES[] = {"system", "user"};
static const char *const GENERATE_CONTENTS[] = {"Be brief.", "Name a colour."};

static const struct {
    const char *name;
    ppoz_request req;
} REQUESTS[] = {
    {"attach-request", {.op = PPOZ_OP_ATTACH, .rid = "a1"}},
    {"attach-request-2", {.op = PPOZ_OP_ATTACH, .rid = "a2", .task_id = "emu-7"}},
    {"ask-request", {.op = PPOZ_OP_ASK, .rid = "k1", .task_id = "emu-7"}},
    {"step-request",
     {.op = PPOZ_OP_STEP, .rid = "s1", .task_id = "emu-7", .prompt = "App: Shop. Views: [0] Cart [1] Search",
      .question = "Which action should I choose next? I shall choose No. ", .actions = STEP_ACTIONS, .n_actions = 2}},
    {"generate-request",
     {.op = PPOZ_OP_GENERATE, .rid = "g1", .task_id = "qa-3", .prompt = "Q: 2 + 3 = ? Answer with a number.\nA:",
      .sampling = {.max_new_tokens = 16, .temperature = 1.0, .top_p = 0.9, .stop = GENERATE_STOP, .n_stop = 1,
                   .has_seed = 1, .seed = 7}}},
    {"generate-request-2",
     {.op = PPOZ_OP_GENERATE, .rid = "g2", .task_id = "qa-3", .roles = GENERATE_ROLES, .contents = GENERATE_CONTENTS,
      .n_messages = 2, .sampling = {.max_new_tokens = 8, .temperature = 0.0, .top_p = 1.0}, .deadline_ms = 20000}},
    {"feedback-request", {.op = PPOZ_OP_FEEDBACK, .rid = "f1", .task_id = "emu-7", .reward = 0.8, .done = 0, .truncated = 0}},
    {"detach-request", {.op = PPOZ_OP_DETACH, .rid = "d1", .task_id = "emu-7"}},
    {"ping-request", {.op = PPOZ_OP_PING, .rid = "p1"}},
};
#define N_REQUESTS (sizeof REQUESTS / sizeof REQUESTS[0])

static int check_request(const char *dir, size_t i)
{
    const char *name = REQUESTS[i].name;
    size_t want_len = 0, got_len = 0;
    char *want = read_file(dir, name, ".msgpack", &want_len);
    if (want == NULL) {
        failed(name, "%s", "the vector is missing");
        return 0;
    }
    char *got = NULL;
    char why[256] = "";
    int ok = 0;
    if (ppoz_encode_request(&REQUESTS[i].req, &got, &got_len, why, sizeof why) != PPOZ_OK)
        failed(name, "ppoz_encode_request failed: %s", why);
    else
        ok = same_bytes(name, "ppoz_encode_request", got, got_len, want, want_len);
    free(got);
    free(want);
    return ok;
}

/* --- 3. Replies ------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    const char *op, *rid, *status, *task_id, *error_code, *error_message, *reason;
    int rc;                 /* ppoz_code_to_rc(error_code) */
    int64_t action;         /* -1: absent */
    int has_logprob;
    double logprob;
    size_t n_probs;
    int64_t policy_version; /* -1: absent */
    int64_t retry_after_ms; /* -1: absent */
    int resumed, segment_closed, dropped_pending_step;
    int64_t segments_closed;
    const char *text;       /* generate: NULL when absent, as n_tokens then is */
    int64_t n_tokens;
    const char *finish_reason;
} expected_reply;

static const expected_reply REPLIES[] = {
    {.name = "attach-reply", .op = "attach", .rid = "a1", .status = "attached", .task_id = "emu-7", .action = -1,
     .policy_version = -1, .retry_after_ms = -1},
    {.name = "ask-reply", .op = "ask", .rid = "k1", .status = "ok", .task_id = "emu-7", .action = -1, .policy_version = -1,
     .retry_after_ms = -1},
    {.name = "ask-reply-2", .op = "ask", .rid = "k1", .status = "wait", .task_id = "emu-7", .reason = "no_actor",
     .action = -1, .policy_version = -1, .retry_after_ms = 1000},
    {.name = "step-reply", .op = "step", .rid = "s1", .status = "ok", .task_id = "emu-7", .action = 1, .has_logprob = 1,
     .logprob = -0.25, .n_probs = 2, .policy_version = 12, .retry_after_ms = -1},
    {.name = "generate-reply", .op = "generate", .rid = "g1", .status = "ok", .task_id = "qa-3", .action = -1,
     .has_logprob = 1, .logprob = -1.5, .policy_version = 12, .retry_after_ms = -1, .text = " 5", .n_tokens = 2,
     .finish_reason = "stop"},
    {.name = "generate-error", .op = "generate", .rid = "g3", .status = "", .error_code = "bad_request",
     .error_message = "unknown `sampling` keys: n; known: max_new_tokens, temperature, top_p, top_k, stop, seed",
     .rc = PPOZ_ERR_BAD_REQUEST, .action = -1, .policy_version = -1, .retry_after_ms = -1},
    {.name = "feedback-reply", .op = "feedback", .rid = "f1", .status = "ok", .task_id = "emu-7", .action = -1,
     .policy_version = -1, .retry_after_ms = -1},
    {.name = "detach-reply", .op = "detach", .rid = "d1", .status = "detached", .task_id = "emu-7", .action = -1,
     .policy_version = -1, .retry_after_ms = -1, .segments_closed = 1},
    {.name = "feedback-error", .op = "feedback", .rid = "f2", .status = "", .error_code = "feedback_without_step",
     .error_message = "task 'emu-7' has no step waiting for a reward; nothing recorded", .rc = PPOZ_ERR_FEEDBACK_WITHOUT_STEP,
     .action = -1, .policy_version = -1, .retry_after_ms = -1},
    {.name = "ask-error", .op = "ask", .rid = "k9", .status = "", .error_code = "unsupported_version",
     .error_message = "this peer speaks proto='ppoz' v=1, got proto='ppoz' v=2", .rc = PPOZ_ERR_UNSUPPORTED_VERSION,
     .action = -1, .policy_version = -1, .retry_after_ms = -1},
};
#define N_REPLIES (sizeof REPLIES / sizeof REPLIES[0])

#define EXPECT(cond, what)                                                                                             \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            failed(e->name, "%s", what);                                                                               \
            ok = 0;                                                                                                    \
        }                                                                                                              \
    } while (0)

static int check_reply(const char *dir, const expected_reply *e)
{
    size_t len = 0;
    char *data = read_file(dir, e->name, ".msgpack", &len);
    if (data == NULL) {
        failed(e->name, "%s", "the vector is missing");
        return 0;
    }
    ppoz_reply r;
    char why[256] = "";
    int ok = 1;
    if (ppoz_parse_reply(data, len, &r, why, sizeof why) != PPOZ_OK) {
        failed(e->name, "ppoz_parse_reply failed: %s", why);
        free(data);
        return 0;
    }
    EXPECT(strcmp(r.op, e->op) == 0, "op");
    EXPECT(r.has_rid && r.rid_len == strlen(e->rid) && strcmp(r.rid, e->rid) == 0, "rid");
    EXPECT(strcmp(r.status, e->status) == 0, "status");
    EXPECT(e->task_id == NULL ? !r.has_task_id : r.has_task_id && strcmp(r.task_id, e->task_id) == 0, "task_id");
    EXPECT(r.is_error == (e->error_code != NULL), "is_error");
    if (e->error_code != NULL) {
        EXPECT(strcmp(r.error_code, e->error_code) == 0, "error code");
        EXPECT(strcmp(r.error_message, e->error_message) == 0, "error message");
        EXPECT(ppoz_code_to_rc(r.error_code) == e->rc, "ppoz_code_to_rc of the error code");
    }
    EXPECT(strcmp(r.reason, e->reason != NULL ? e->reason : "") == 0, "reason");
    EXPECT(e->action < 0 ? !r.has_action : r.has_action && r.action == e->action, "action");
    EXPECT(e->has_logprob ? r.has_logprob && r.logprob == e->logprob : !r.has_logprob, "logprob");
    EXPECT(r.n_probs == e->n_probs, "probs");
    EXPECT(e->policy_version < 0 ? !r.has_policy_version : r.has_policy_version && r.policy_version == e->policy_version,
           "policy_version");
    EXPECT(e->retry_after_ms < 0 ? !r.has_retry_after_ms : r.has_retry_after_ms && r.retry_after_ms == e->retry_after_ms,
           "retry_after_ms");
    EXPECT(r.resumed == e->resumed && r.segment_closed == e->segment_closed && r.dropped_pending_step == e->dropped_pending_step,
           "bool fields");
    EXPECT(r.segments_closed == e->segments_closed, "segments_closed");
    EXPECT(e->text == NULL ? !r.has_text : r.has_text && r.text_len == strlen(e->text) && r.text_full_len == r.text_len &&
                                               !r.text_truncated && strcmp(r.text, e->text) == 0,
           "text");
    EXPECT(e->text == NULL ? !r.has_n_tokens : r.has_n_tokens && r.n_tokens == e->n_tokens, "n_tokens");
    EXPECT(strcmp(r.finish_reason, e->finish_reason != NULL ? e->finish_reason : "") == 0, "finish_reason");
    free(data);
    return ok;
}

/* --- Main ------------------------------------------------------------------------------- */

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static int covered(const char *name)
{
    for (size_t i = 0; i < N_REQUESTS; i++)
        if (strcmp(REQUESTS[i].name, name) == 0)
            return 1;
    for (size_t i = 0; i < N_REPLIES; i++)
        if (strcmp(REPLIES[i].name, name) == 0)
            return 1;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s VECTORS_DIR\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    DIR *d = opendir(dir);
    if (d == NULL) {
        perror(dir);
        return 2;
    }
    char **names = NULL;
    size_t n = 0;
    struct dirent *ent;
    while ((ent = readdir(d)) != NULL) {
        if (!ends_with(ent->d_name, ".msgpack"))
            continue;
        char **grown = realloc(names, (n + 1) * sizeof *names);
        if (grown == NULL)
            break;
        names = grown;
        names[n] = strdup(ent->d_name);
        names[n][strlen(names[n]) - strlen(".msgpack")] = '\0';
        n++;
    }
    closedir(d);
    if (names != NULL)
        qsort(names, n, sizeof *names, cmp_names);

    size_t trips = 0, requests = 0, replies = 0;
    for (size_t i = 0; i < n; i++) {
        trips += (size_t)round_trip(dir, names[i]);
        if (!covered(names[i]))
            printf("note %s: round trip only (no field check in test_vectors.c)\n", names[i]);
    }
    for (size_t i = 0; i < N_REQUESTS; i++)
        requests += (size_t)check_request(dir, i);
    for (size_t i = 0; i < N_REPLIES; i++)
        replies += (size_t)check_reply(dir, &REPLIES[i]);
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);

    if (n == 0)
        failed(dir, "%s", "no .msgpack vectors found");
    printf("test_vectors: round trip %zu/%zu, requests %zu/%zu, replies %zu/%zu: %s\n", trips, n, requests,
           (size_t)N_REQUESTS, replies, (size_t)N_REPLIES, failures == 0 ? "ok" : "FAILED");
    return failures == 0 ? 0 : 1;
}
