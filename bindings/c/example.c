/*
 * ppoz_example: a Kea-like environment client in C.
 *
 *   ppoz_example ENDPOINT [EPISODES=3] [STEPS=4] [DEADLINE_MS=60000] [ATTEMPT_TIMEOUT_MS=10000]
 *
 * Attaches one task, then for each episode and step: asks whether it may step
 * (sleeping `retry_after_ms` on "wait", for at most DEADLINE_MS in all, then
 * stepping anyway since ask is advisory), steps with a Kea-like prompt and
 * three candidate actions, and sends the reward (1.0 for candidate 1, else
 * 0.0; done on the episode's last step). Detaches at the end. Prints one line
 * per episode and `episodes N steps M`; exit 0. On any error it prints the
 * error code and message to stderr and exits 1.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ppoz.h"

static const char *const ACTIONS[] = {
    "0: TouchEvent(view=Cart)",
    "1: TouchEvent(view=Search)",
    "2: KeyEvent(name=BACK)",
};
#define N_ACTIONS (sizeof ACTIONS / sizeof ACTIONS[0])
static const char QUESTION[] = "Which action should I choose next? I shall choose No. ";

static int parse_positive(const char *text, const char *name, int *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || v <= 0 || v > INT_MAX) {
        fprintf(stderr, "ppoz_example: %s must be a positive integer, got \"%s\"\n", name, text);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* Ask until the broker says "ok", sleeping as told; after `budget_ms` of waiting, step anyway. */
static int wait_until_ready(ppoz_client *c, const char *task, int budget_ms)
{
    int waited = 0;
    for (;;) {
        int ready = 0, retry_after_ms = 0;
        int rc = ppoz_ask(c, task, &ready, &retry_after_ms);
        if (rc != PPOZ_OK || ready || waited >= budget_ms)
            return rc;
        if (retry_after_ms <= 0)
            retry_after_ms = PPOZ_DEFAULT_RETRY_AFTER_MS;
        sleep_ms(retry_after_ms);
        waited += retry_after_ms;
    }
}

static int fail(ppoz_client *c, const char *what)
{
    fprintf(stderr, "ppoz_example: %s failed: %s: %s\n", what, ppoz_error_code(c), ppoz_error_message(c));
    ppoz_close(c);
    return 1;
}

int main(int argc, char **argv)
{
    int episodes = 3, steps = 4, deadline_ms = 60000, attempt_ms = 10000;
    if (argc < 2 || argc > 6 || (argc > 2 && parse_positive(argv[2], "EPISODES", &episodes) != 0) ||
        (argc > 3 && parse_positive(argv[3], "STEPS", &steps) != 0) ||
        (argc > 4 && parse_positive(argv[4], "DEADLINE_MS", &deadline_ms) != 0) ||
        (argc > 5 && parse_positive(argv[5], "ATTEMPT_TIMEOUT_MS", &attempt_ms) != 0)) {
        fprintf(stderr, "usage: %s ENDPOINT [EPISODES=3] [STEPS=4] [DEADLINE_MS=60000] [ATTEMPT_TIMEOUT_MS=10000]\n",
                argc > 0 ? argv[0] : "ppoz_example");
        return 2;
    }
    if (argc <= 5 && attempt_ms > deadline_ms)
        attempt_ms = deadline_ms;
    setvbuf(stdout, NULL, _IOLBF, 0);

    ppoz_client *c = ppoz_open(argv[1], deadline_ms, attempt_ms);
    if (c == NULL) {
        fprintf(stderr, "ppoz_example: cannot open a client for \"%s\": %s\n", argv[1], strerror(errno));
        return 1;
    }
    char task[PPOZ_TASK_ID_CAP] = ""; /* empty: the broker chooses the task id */
    if (ppoz_attach(c, task, sizeof task) != PPOZ_OK)
        return fail(c, "attach");
    printf("attached %s\n", task);

    int total_steps = 0;
    for (int episode = 1; episode <= episodes; episode++) {
        double episode_return = 0.0;
        int policy_version = 0;
        char taken[64] = "";
        for (int step = 0; step < steps; step++) {
            if (wait_until_ready(c, task, deadline_ms) != PPOZ_OK)
                return fail(c, "ask");
            char prompt[512];
            snprintf(prompt, sizeof prompt,
                     "You are testing the app Shop (episode %d, step %d of %d). Current activity: MainActivity. "
                     "Views: [0] Cart button [1] Search box. History: %s. The candidate actions are:",
                     episode, step + 1, steps, taken[0] != '\0' ? taken : "none");
            int action = -1;
            if (ppoz_step(c, task, prompt, QUESTION, ACTIONS, N_ACTIONS, &action, &policy_version) != PPOZ_OK)
                return fail(c, "step");
            double reward = action == 1 ? 1.0 : 0.0;
            int done = step == steps - 1;
            if (ppoz_feedback(c, task, reward, done, 0) != PPOZ_OK)
                return fail(c, "feedback");
            episode_return += reward;
            total_steps++;
            size_t used = strlen(taken);
            if (used + 4 < sizeof taken)
                snprintf(taken + used, sizeof taken - used, "%s%d", used > 0 ? "," : "", action);
        }
        printf("episode %d: steps %d return %.1f actions [%s] policy_version %d\n", episode, steps, episode_return, taken,
               policy_version);
    }
    if (ppoz_detach(c, task) != PPOZ_OK)
        return fail(c, "detach");
    printf("episodes %d steps %d\n", episodes, total_steps);
    ppoz_close(c);
    return 0;
}
